"""The one model-dimensions record: :class:`ModelDims`, parsed once from a Hugging Face ``config.json``.

Every reader of a model's shape (the converter and the families' rules, validation, the memory planner, the
performance model, the reference runtime) derives from this record instead of reading config keys itself, so a
key read differently in two places cannot drift. Model types spell the same fact differently (GPT-J's ``n_embd``,
Falcon's ``num_kv_heads``, DeepSeek's ``n_routed_experts``): :data:`KEY_ALIASES` renames them, a table in the manner
of transformers' ``attribute_map``. A TensorRT-LLM checkpoint ``config.json`` (what the runtime and the planner
read) is the same facts under TensorRT-LLM's names: :func:`checkpoint_view` renames it back (the inverse of
``trtllm_config.build_config``) and the same :func:`parse_hf_config` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import read_json, refuse_special_files
from trtpipe.models.hfconfig import layer_types_of, rope_of, text_config

# model_type -> {the name trtpipe reads: the name this model type's config.json uses}
KEY_ALIASES: dict[str, dict[str, str]] = {
    "gptj": {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "num_attention_heads": "n_head",
        "intermediate_size": "n_inner",
        "max_position_embeddings": "n_positions",
    },
    "falcon": {"num_key_value_heads": "num_kv_heads"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "mtp_layers": "num_nextn_predict_layers"},
    "kimi_k2": {"num_local_experts": "n_routed_experts", "mtp_layers": "num_nextn_predict_layers"},
    "qwen3_moe": {"interleave_moe_layer_step": "decoder_sparse_step"},
    # Llama 4: ``intermediate_size`` is one expert's width, ``intermediate_size_mlp`` the dense layers'
    "llama4_text": {"intermediate_size": "intermediate_size_mlp", "moe_intermediate_size": "intermediate_size"},
}

# model_type -> the transformers defaults (or derived values) of keys its configs may omit, from the config so far
TYPE_DEFAULTS: dict[str, Callable[[dict], dict]] = {
    "gptj": lambda c: {"n_inner": 4 * c["n_embd"]} if c.get("n_embd") else {},  # GPTJMLP: n_inner or 4 * n_embd
    # FalconConfig: multi-query (one KV head) unless new_decoder_architecture; embeddings tied; MLP 4 x hidden
    "falcon": lambda c: {
        "num_kv_heads": c.get("num_attention_heads") if c.get("new_decoder_architecture") else 1,
        "tie_word_embeddings": True,
        **({"intermediate_size": 4 * c["hidden_size"]} if c.get("hidden_size") else {}),
    },
    # Llama4TextConfig: every 4th layer is a no-RoPE (global) one; MoE every interleave_moe_layer_step-th layer
    "llama4_text": lambda c: {"no_rope_layer_interval": 4},
    "gpt_oss": lambda c: {"attention_sinks": True},  # a learned softmax logit per query head
    # Qwen3MoeConfig.norm_topk_prob defaults to false (the released models set it true)
    "qwen3_moe": lambda c: {"norm_topk_prob": False},
    # DeepseekV3Config (transformers 5.25): sigmoid scores (DeepseekV3TopkRouter hard-codes them), interleaved rope
    # pairs, the DeepSeek-V3 group routing; Kimi-K2's config.json spells every one of them
    "deepseek_v3": lambda c: DEEPSEEK_V3_DEFAULTS,
    "kimi_k2": lambda c: DEEPSEEK_V3_DEFAULTS,
}

DEEPSEEK_V3_DEFAULTS = {
    "scoring_func": "sigmoid",
    "rope_interleave": True,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
}

# A TensorRT-LLM checkpoint config.json key -> the HF key of the same fact (trtllm_config.build_config writes them)
CHECKPOINT_KEYS = {
    "head_size": "head_dim",
    "norm_epsilon": "rms_norm_eps",
    "rotary_base": "rope_theta",
    "rotary_scaling": "rope_scaling",
    "rotary_embedding_dim": "rotary_dim",
    "rotary_pct": "partial_rotary_factor",
    "dtype": "torch_dtype",
    "attn_bias": "attention_bias",
    "moe_num_experts": "num_local_experts",
    "moe_top_k": "num_experts_per_tok",
}


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's ranks (DeepSeek V3): q and kv are projected through low-rank latents.

    ``q_lora_rank`` 0: q is one full projection (``q_proj``; DeepSeek-V2-Lite's ``q_lora_rank: null``). The KV cache
    holds ``kv_lora_rank + qk_rope_head_dim`` values per token per layer (the latent and the shared rope key)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_values_per_token(self) -> int:
        """Values cached per token per layer: the latent plus the rope key (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelDims:
    """A model's dimensions and per-layer pattern, as its config.json states them (defaults filled in)."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's width (the experts' where the config has only one width)
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
    moe_intermediate_size: int = 0  # Qwen3-MoE, DeepSeek, Llama 4: each expert's width apart from the dense MLP's
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention" where the model mixes them
    rope_local_theta: Optional[float] = None  # the rope base of sliding layers when it differs (Gemma 3), unscaled
    weight_prefix: str = ""  # where the language model's tensors live ("language_model." in a multimodal checkpoint)
    rotary_dim: int = 0  # channels of a head that RoPE rotates (head_dim unless partial)
    moe_renormalize: bool = True  # the top-k routing weights are divided by their sum (Qwen3-MoE: norm_topk_prob)
    shared_experts: int = 0  # experts every token goes through beside the routed ones (DeepSeek)
    dense_layers: int = 0  # leading layers with a dense MLP before the MoE ones (DeepSeek first_k_dense_replace)
    moe_layer_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 (Llama 4 interleave_moe_layer_step)
    no_rope_layer_interval: int = 0  # layer i has no RoPE (global attention) iff (i + 1) % interval == 0 (Llama 4)
    attention_chunk: int = 0  # RoPE layers attend within chunks of this many positions (Llama 4)
    mla: Optional[MLA] = None
    moe_scoring: str = "softmax"  # "sigmoid": DeepSeek-V3's per-expert sigmoid scores (scoring_func)
    moe_groups: int = 1  # n_group: experts split into groups; the top topk_group groups are kept (DeepSeek-V3)
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this (DeepSeek-V3 2.5)
    rope_interleave: bool = False  # rope rotates interleaved pairs (x0, x1), (x2, x3) (DeepSeek-V3)
    mtp_layers: int = 0  # multi-token-prediction layers stored after the decoder layers (num_nextn_predict_layers)
    attention_sinks: bool = False  # one learned softmax logit per query head (gpt-oss)
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (Gemma)
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    swiglu_alpha: Optional[float] = None  # gpt-oss's clamped SwiGLU experts
    swiglu_limit: Optional[float] = None
    quant_method: Optional[str] = None  # quantization_config.quant_method of a pre-quantized source
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_intermediate_size(self) -> int:
        """The width of one expert's MLP: ``moe_intermediate_size`` where the config has it, else the MLP's."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.dense_layers and (i + 1) % self.moe_layer_step == 0


def parse_hf_config(
    cfg: dict[str, Any], source: str = "config.json", required: tuple[str, ...] = ("architectures", "intermediate_size")
) -> ModelDims:
    """Turn a loaded HF config dict into :class:`ModelDims`; raise naming the missing key (``required``: keys with
    no default that this reader needs; the performance model reads published configs that omit some)."""
    raw, weight_prefix = text_config(cfg)
    mt = str(raw.get("model_type", ""))
    cfg = {**TYPE_DEFAULTS.get(mt, lambda c: {})(raw), **{k: v for k, v in raw.items() if v is not None}}
    alias = KEY_ALIASES.get(mt, {})

    def get(key: str, default: Any = None) -> Any:
        value = cfg.get(alias.get(key, key))
        return default if value is None else value

    def need(key: str) -> Any:
        if get(key) is None:
            raise CheckpointError(f"{source}: required key '{alias.get(key, key)}' is missing")
        return get(key)

    def whole(key: str, default: Any = None) -> int:
        """The key (or ``default`` when absent, null or 0) as an int; a one-line error naming the key."""
        value = get(key) or default
        if value is None:
            return int(need(key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise CheckpointError(f"{source}: key '{alias.get(key, key)}': expected a whole number, got {value!r}")
        return int(value)

    def number(key: str, default: Optional[float]) -> Optional[float]:
        value = get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise CheckpointError(f"{source}: key '{key}': expected a number, got {value!r}")
        return None if value is None else float(value)

    def scalar(key: str) -> Optional[float]:
        """An optional number kept as the file writes it (168 stays an int), so configs written from it match."""
        number(key, None)  # the type check
        return get(key)

    archs = cfg.get("architectures") or []
    hidden = whole("hidden_size")
    heads = whole("num_attention_heads")
    head_dim = whole("head_dim", hidden // heads if heads else None)
    theta, scaling = rope_of(raw)
    num_layers = whole("num_hidden_layers")
    layer_types = layer_types_of(raw, num_layers)
    if layer_types and len(layer_types) != num_layers:
        raise CheckpointError(f"{source}: key 'layer_types' has {len(layer_types)} entries for {num_layers} layers")
    mla = None
    if get("kv_lora_rank"):
        mla = MLA(
            whole("q_lora_rank", 0) if get("q_lora_rank") is not None else 0,  # null: a full q projection
            *(whole(k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")),
        )
        head_dim = mla.qk_head_dim  # q and k heads are nope + rope wide (a saved DeepseekV3Config says the rope's)
    return ModelDims(
        architecture=archs[0] if archs else ("" if "architectures" not in required else need("architectures")),
        model_type=mt,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=whole("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=whole("intermediate_size", None if "intermediate_size" in required else 0),
        vocab_size=whole("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=number("rms_norm_eps", 1e-5),
        rope_theta=theta if theta is not None else 10000.0,
        rope_scaling=scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        torch_dtype=str(get("torch_dtype") or get("dtype") or "float32"),
        attention_bias=bool(get("attention_bias", mt == "qwen2")),
        mlp_bias=bool(get("mlp_bias", False)),
        hidden_act=str(get("hidden_act") or get("hidden_activation") or "silu"),
        sliding_window=get("sliding_window") if raw.get("use_sliding_window", True) else None,
        num_experts=whole("num_local_experts", get("num_experts") or 0),
        experts_per_token=whole("num_experts_per_tok", 0),
        moe_intermediate_size=whole("moe_intermediate_size", 0),
        layer_types=layer_types,
        rope_local_theta=rope_of(raw, "sliding_attention")[0] if "sliding_attention" in layer_types else None,
        weight_prefix=weight_prefix,
        rotary_dim=mla.qk_rope_head_dim
        if mla
        else whole("rotary_dim", 0) or int(head_dim * number("partial_rotary_factor", 1.0)),
        moe_renormalize=bool(get("norm_topk_prob", True)),
        shared_experts=whole("n_shared_experts", 0),
        dense_layers=whole("first_k_dense_replace", 0),
        moe_layer_step=whole("interleave_moe_layer_step", 1),
        no_rope_layer_interval=whole("no_rope_layer_interval", 0),
        attention_chunk=whole("attention_chunk_size", 0),
        mla=mla,
        moe_scoring=str(get("scoring_func", "softmax")),
        moe_groups=whole("n_group", 1),
        moe_topk_groups=whole("topk_group", 1),
        routed_scaling_factor=number("routed_scaling_factor", 1.0),
        rope_interleave=bool(get("rope_interleave", False)),
        mtp_layers=whole("mtp_layers", 0),
        attention_sinks=bool(get("attention_sinks", False)),
        query_pre_attn_scalar=scalar("query_pre_attn_scalar"),
        final_logit_softcapping=scalar("final_logit_softcapping"),
        attn_logit_softcapping=scalar("attn_logit_softcapping"),
        swiglu_alpha=scalar("swiglu_alpha"),
        swiglu_limit=scalar("swiglu_limit"),
        quant_method=(get("quantization_config") or {}).get("quant_method"),
        raw=raw,
    )


def read_hf_config(model_dir: str | Path) -> ModelDims:
    """Read ``<model_dir>/config.json``; a clear error when it is missing or not JSON, when any file of the
    directory is a FIFO or device (the build reads them: it would block), or when a value is NaN or infinite."""
    path = Path(model_dir) / "config.json"
    refuse_special_files(Path(model_dir), CheckpointError)
    cfg = read_json(path, f"{model_dir} a Hugging Face model directory", CheckpointError)
    return parse_hf_config(cfg, str(path))


def checkpoint_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """A TensorRT-LLM checkpoint config.json under HF key names (``CHECKPOINT_KEYS``, the ``moe`` block, the one
    ``architecture``), with TensorRT-LLM's ``PretrainedConfig`` default for an absent intermediate size (4 x hidden)."""
    hf = {CHECKPOINT_KEYS.get(k, k): v for k, v in cfg.items()}
    moe = cfg.get("moe") or {}
    hf["num_local_experts"] = moe.get("num_experts") or cfg.get("moe_num_experts") or 0
    hf["num_experts_per_tok"] = moe.get("top_k") or cfg.get("moe_top_k") or 0
    hf["norm_topk_prob"] = int(moe.get("normalization_mode", 1)) == 1  # 1: RENORMALIZE
    hf["architectures"] = [cfg.get("architecture", "")]
    if not cfg.get("intermediate_size") and isinstance(cfg.get("hidden_size"), int):
        hf["intermediate_size"] = 4 * cfg["hidden_size"]
    return hf


def checkpoint_dims(cfg: dict[str, Any], source: str = "config.json") -> ModelDims:
    """:class:`ModelDims` of a TensorRT-LLM checkpoint config.json (the same parser, over :func:`checkpoint_view`)."""
    return parse_hf_config(checkpoint_view(cfg), source, required=())
