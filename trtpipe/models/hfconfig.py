"""Read a Hugging Face ``config.json`` into the few numbers trtpipe needs, before any weight is touched.

Handles both rope layouts: transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters``, which may hold ``rope_theta`` and the scaling keys together, or, for models whose layers
differ (Gemma 3), one such dict per layer type: ``{"sliding_attention": {...}, "full_attention": {...}}``).

A multimodal ``*ForConditionalGeneration`` config (Gemma 3) is read through its ``text_config``: the language
model is what trtpipe builds. Hub text configs omit what equals the transformers defaults, so those defaults
(``TEXT_CONFIG_DEFAULTS``, from transformers ``models/gemma3/configuration_gemma3.py`` ``Gemma3TextConfig``) fill
the keys the file does not set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import read_json


QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")  # a per-head RMSNorm of q and of k (head_dim weights each)
EXTRA_NORMS = {"gemma3_text": 2}
BIASED_MOE_MODEL_TYPES = ("gpt_oss",)  # q/k/v/o, router and expert biases, and attention sinks  # per-layer norms beyond input/post-attention (Gemma 3: pre/post feed-forward)

# model_type -> the transformers defaults of the keys its published configs may omit (transformers 5.24
# Gemma3TextConfig; rope_theta 1e6 for global layers, rope_local_base_freq 1e4 for sliding ones).
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "attention_bias": False, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "sliding_window_pattern": 6, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    },
}


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
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention" where the model mixes them
    rope_local_theta: Optional[float] = None  # the rope base of sliding layers when it differs (Gemma 3), unscaled
    weight_prefix: str = ""  # where the language model's tensors live ("language_model." in a multimodal checkpoint)
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
        per_layer = attn + mlp + (2 + EXTRA_NORMS.get(self.model_type, 0)) * h + qk_norms
        if self.model_type in BIASED_MOE_MODEL_TYPES:  # q/k/v/o, router and expert biases, one sink per head
            per_layer += (self.num_heads + 2 * self.num_kv_heads) * d + h + self.num_heads
            per_layer += self.num_experts * (1 + 2 * self.expert_intermediate_size + h)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


def nested_rope(cfg: dict) -> Optional[dict]:
    """transformers 5's per-layer-type ``rope_parameters`` ({"full_attention": {...}, ...}), or None."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return params
    return None


def rope_of(cfg: dict, layer_type: str = "full_attention") -> tuple[Optional[float], Optional[dict]]:
    """(theta, scaling) of one layer type. Per-layer-type nesting: that type's entry (``full_attention`` is the
    global rope); without nesting, the transformers-4 keys (``rope_local_base_freq`` for sliding layers, unscaled,
    as Gemma 3's ``rope_local_base_freq`` is)."""
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    nested = nested_rope(cfg)
    if nested is not None:
        params = nested.get(layer_type) or nested.get("full_attention") or next(iter(nested.values()))
        scaling = None
        theta = cfg.get("rope_local_base_freq", theta) if layer_type == "sliding_attention" else theta
    elif layer_type == "sliding_attention":
        return (None if cfg.get("rope_local_base_freq") is None else float(cfg["rope_local_base_freq"])), None
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = rest.get("rope_type", rest.get("type"))
        if kind and kind != "default":
            scaling = rest
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
    return (None if theta is None else float(theta)), scaling


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the language model's config, the prefix of its tensors): a multimodal ConditionalGeneration config is
    read through its ``text_config`` (its top-level ``architectures`` kept: it names the checkpoint's layout);
    the defaults of ``TEXT_CONFIG_DEFAULTS`` fill what the file omits."""
    prefix = ""
    if isinstance(cfg.get("text_config"), dict):
        top = cfg
        cfg = dict(top["text_config"])
        cfg["architectures"] = top.get("architectures") or cfg.get("architectures")
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in top and key not in cfg:
                cfg[key] = top[key]
        cfg.setdefault("model_type", f"{top.get('model_type', '')}_text")
        prefix = "language_model."  # what transformers' save_pretrained writes (language_model.model.*)
    for key, value in TEXT_CONFIG_DEFAULTS.get(str(cfg.get("model_type", "")), {}).items():
        cfg.setdefault(key, value)
    return cfg, prefix


def _layer_types(cfg: dict, num_layers: int) -> tuple[str, ...]:
    """``layer_types`` (transformers 5) or Gemma's ``sliding_window_pattern`` (4.x: layer i global iff (i+1) % n == 0)."""
    if isinstance(cfg.get("layer_types"), list):
        return tuple(str(t) for t in cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
    if isinstance(pattern, int) and pattern > 0:
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
    return ()


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

    cfg, weight_prefix = text_config(cfg)
    archs = cfg.get("architectures") or []
    hidden = whole("hidden_size")
    heads = whole("num_attention_heads")
    kv_heads = whole("num_key_value_heads", heads)
    head_dim = whole("head_dim", hidden // heads if heads else None)
    theta, scaling = rope_of(cfg)
    num_layers = whole("num_hidden_layers")
    layer_types = _layer_types(cfg, num_layers)
    if layer_types and len(layer_types) != num_layers:
        raise CheckpointError(f"{source}: key 'layer_types' has {len(layer_types)} entries for {num_layers} layers")
    local_theta = rope_of(cfg, "sliding_attention")[0] if "sliding_attention" in layer_types else None
    return HFModelInfo(
        architecture=archs[0] if archs else need("architectures"),
        model_type=str(cfg.get("model_type", "")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=whole("intermediate_size"),
        vocab_size=whole("vocab_size"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        rms_norm_eps=number("rms_norm_eps", 1e-5),
        rope_theta=theta if theta is not None else 10000.0,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        num_experts=whole("num_local_experts", cfg.get("num_experts") or 0),
        experts_per_token=whole("num_experts_per_tok", 0),
        moe_intermediate_size=whole("moe_intermediate_size", 0),
        layer_types=layer_types,
        rope_local_theta=local_theta,
        weight_prefix=weight_prefix,
        raw=cfg,
    )


def read_hf_config(model_dir: str | Path) -> HFModelInfo:
    """Read ``<model_dir>/config.json``; a clear error when it is missing or not JSON."""
    path = Path(model_dir) / "config.json"
    cfg = read_json(path, f"{model_dir} a Hugging Face model directory", CheckpointError)
    return parse_hf_config(cfg, str(path))
