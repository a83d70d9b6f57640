"""Read a Hugging Face ``config.json`` into the few numbers trtpipe needs, before any weight is touched.

Handles both rope layouts: transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters``, which may hold ``rope_theta`` and the scaling keys together).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import read_json


QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # a per-head RMSNorm of q and of k (head_dim weights each) per layer


@dataclass(frozen=True)
class HFModelInfo:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: Optional[int]
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    torch_dtype: str
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: Optional[int] = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # Qwen3-MoE: each expert's width (intermediate_size is the dense MLP's)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_intermediate_size(self) -> int:
        """The width of one expert's MLP: ``moe_intermediate_size`` where the config has it, else the MLP's."""
        return self.moe_intermediate_size or self.intermediate_size

    def num_params(self) -> int:
        """Parameter count from the shapes (no weights read)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        if self.is_moe:
            mlp = 3 * h * self.expert_intermediate_size * self.num_experts + h * self.num_experts
        else:
            mlp = 3 * h * i
        qk_norms = 2 * d if self.model_type in QK_NORM_MODEL_TYPES else 0
        per_layer = attn + mlp + 2 * h + qk_norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


def _rope(cfg: dict) -> tuple[float, Optional[dict]]:
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict):
        # transformers 5: one dict; per-layer-type nesting ({"full_attention": {...}}) takes the first entry.
        if params and all(isinstance(v, dict) for v in params.values()):
            params = next(iter(params.values()))
        theta = params.get("rope_theta", theta)
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = rest.get("rope_type", rest.get("type"))
        if kind and kind != "default":
            scaling = rest
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def parse_hf_config(cfg: dict[str, Any], source: str = "config.json") -> HFModelInfo:
    """Turn a loaded HF config dict into :class:`HFModelInfo`; raise naming the missing key."""

    def need(key: str, *alternatives: str) -> Any:
        for k in (key, *alternatives):
            if cfg.get(k) is not None:
                return cfg[k]
        raise CheckpointError(f"{source}: required key '{key}' is missing")

    def whole(key: str, default: Any = None) -> int:
        """``cfg[key]`` (or ``default`` when absent, null or 0) as an int; a one-line error naming the key."""
        value = cfg.get(key) or default
        if value is None:
            return int(need(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise CheckpointError(f"{source}: key '{key}': expected a whole number, got {value!r}")
        return int(value)

    def number(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{source}: key '{key}': expected a number, got {value!r}")
        return float(value)

    archs = cfg.get("architectures") or []
    hidden = whole("hidden_size")
    heads = whole("num_attention_heads")
    kv_heads = whole("num_key_value_heads", heads)
    head_dim = whole("head_dim", hidden // heads if heads else None)
    theta, scaling = _rope(cfg)
    return HFModelInfo(
        architecture=archs[0] if archs else need("architectures"),
        model_type=str(cfg.get("model_type", "")),
        hidden_size=hidden,
        num_layers=whole("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=whole("intermediate_size"),
        vocab_size=whole("vocab_size"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        rms_norm_eps=number("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        num_experts=whole("num_local_experts", cfg.get("num_experts") or 0),
        experts_per_token=whole("num_experts_per_tok", 0),
        moe_intermediate_size=whole("moe_intermediate_size", 0),
        raw=cfg,
    )


def read_hf_config(model_dir: str | Path) -> HFModelInfo:
    """Read ``<model_dir>/config.json``; a clear error when it is missing or not JSON."""
    path = Path(model_dir) / "config.json"
    cfg = read_json(path, f"{model_dir} a Hugging Face model directory", CheckpointError)
    return parse_hf_config(cfg, str(path))
