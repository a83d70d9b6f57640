"""The TensorRT-LLM checkpoint ``config.json`` for a converted HF model (trtllm-checkpoint.md#configjson).

Every field the builder and the C++ runtime read is written explicitly, including ``rotary_base`` and
``rotary_scaling`` (taken from either HF rope layout by ``hfconfig``), so nothing falls back to a default
that differs from the HF model.
"""

from __future__ import annotations

import math
from typing import Optional

from trtpipe.errors import CheckpointError
from trtpipe.models.family import Family
from trtpipe.models.dims import ModelDims

DTYPES = ("float16", "bfloat16", "float32")

# rope scaling types whose factor does not extend max_position_embeddings (trtllm-build's --max_seq_len deduction,
# docs/reference/trtllm-build.md#general-flags)
_NO_FACTOR_ROPE = ("su", "longrope", "llama3")

# TRT-LLM convert_checkpoint --dtype auto: float32 sources become float16, half types are kept.
AUTO_DTYPE = {"float32": "float16", "float16": "float16", "bfloat16": "bfloat16"}


def resolve_dtype(requested: str, source_dtype: str) -> str:
    """The checkpoint dtype for ``--dtype`` (auto: follow TensorRT-LLM's rule on the source weights' dtype)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise CheckpointError(f"dtype: '{requested}' is not one of auto, {', '.join(DTYPES)}")
        return requested
    source = source_dtype.replace("torch.", "")
    if source not in AUTO_DTYPE:
        raise CheckpointError(f"dtype: auto cannot map source dtype '{source_dtype}'; pass --dtype explicitly")
    return AUTO_DTYPE[source]


def rotary_scaling(info: ModelDims) -> Optional[dict]:
    """HF rope scaling dict with both ``type`` and ``rope_type`` keys (TRT-LLM versions read either)."""
    if not info.rope_scaling:
        return None
    scaling = dict(info.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    scaling["type"] = scaling["rope_type"] = kind
    return scaling


def resolve_moe_sizes(tp: int, moe_ep: int = -1, moe_tp: int = -1) -> tuple[int, int]:
    """``(moe_ep, moe_tp)`` as TensorRT-LLM's Mapping resolves them: both -1 means (1, tp); one derives the other."""
    if moe_ep == -1 and moe_tp == -1:
        return 1, tp
    if moe_ep == -1:
        return max(1, tp // moe_tp), moe_tp
    if moe_tp == -1:
        return moe_ep, max(1, tp // moe_ep)
    return moe_ep, moe_tp


def mapping(
    tp: int, pp: int, moe_tp: int = -1, moe_ep: int = -1, num_experts: int = 0, attention_dp: bool = False
) -> dict:
    """``mapping`` with the MoE sizes resolved as TensorRT-LLM's Mapping does; ``enable_attention_dp`` (the
    Mapping field of NVIDIA/TensorRT-LLM@05ebebb2 ``tensorrt_llm/mapping.py``) only where it is on, so that every
    other checkpoint's config.json stays as it was."""
    moe_ep, moe_tp = resolve_moe_sizes(tp, moe_ep, moe_tp) if num_experts else (1, tp)
    out = {
        "world_size": tp * pp,
        "gpus_per_node": 8,
        "cp_size": 1,
        "tp_size": tp,
        "pp_size": pp,
        "moe_tp_size": moe_tp,
        "moe_ep_size": moe_ep,
        "moe_cluster_size": 1,
        "attn_tp_size": -1,
        "attn_cp_size": -1,
    }
    if attention_dp:
        out["enable_attention_dp"] = True
    return out


def quantization(quant_algo=None, kv_cache_quant_algo=None, exclude_modules=None, **extra) -> dict:
    return {
        "quant_algo": quant_algo,
        "kv_cache_quant_algo": kv_cache_quant_algo,
        "group_size": 128,
        "smoothquant_val": 0.5,
        "clamp_val": None,
        "use_meta_recipe": False,
        "has_zero_point": False,
        "pre_quant_scale": False,
        "exclude_modules": exclude_modules,
        **extra,
    }


def shape_fields(info: ModelDims) -> dict:
    """The model's sizes under TensorRT-LLM's config.json names (the checkpoint writes them; ``trtpipe inspect``
    shows an HF model in the same words)."""
    return {
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_size": info.head_dim,
        "intermediate_size": info.intermediate_size,
    }


def build_config(
    info: ModelDims,
    family: Family,
    dtype: str,
    tp: int = 1,
    pp: int = 1,
    moe_tp: int = -1,
    moe_ep: int = -1,
    use_parallel_embedding: bool = False,
    embedding_sharding_dim: int = 0,
    attention_dp: bool = False,
) -> dict:
    """The config.json dict of the unquantized checkpoint (``Family.parallel_embedding_at_tp``: vocab-sharded
    embedding at tp > 1, as that family's TensorRT-LLM config class forces)."""
    if family.parallel_embedding_at_tp and tp > 1 and not attention_dp:  # attention DP: whole tables per rank
        if use_parallel_embedding and embedding_sharding_dim != 0:
            raise CheckpointError(
                f"{info.architecture}: TensorRT-LLM shards this family's embedding over the "
                f"vocabulary (dim 0) at tp > 1; embedding_sharding_dim {embedding_sharding_dim} is not possible"
            )
        use_parallel_embedding, embedding_sharding_dim = True, 0
    cfg = {
        "architecture": info.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        **shape_fields(info),
        "hidden_act": info.hidden_act,
        "norm_epsilon": info.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": info.max_position_embeddings,
        "rotary_base": info.rope_theta,
        "rotary_scaling": rotary_scaling(info),
        "rotary_embedding_dim": info.head_dim,
        "rotary_pct": 1.0,
        "use_parallel_embedding": use_parallel_embedding,
        "embedding_sharding_dim": embedding_sharding_dim,
        "tie_word_embeddings": info.tie_word_embeddings,
        "share_embedding_table": False,  # lm_head.weight is always written (padded and split like the builder expects)
        "qk_layernorm": False,
        "bias": False,
        "rmsnorm": True,
        "residual_mlp": False,
        "disable_weight_only_quant_plugin": False,
        "remove_duplicated_kv_heads": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "output_multiplier_scale": 1.0,
        "fc_after_embed": False,
        "use_input_layernorm_in_first_layer": True,
        "use_last_layernorm": True,
        "layer_idx_offset": 0,
        "moe": {"num_experts": 0, "top_k": 0, "normalization_mode": 1},
        "mapping": mapping(tp, pp, moe_tp, moe_ep, info.num_experts if info.is_moe else 0, attention_dp),
        "quantization": quantization(),
    }
    if info.sliding_window:
        cfg["sliding_window"] = int(info.sliding_window)
    cfg.update(family.config_fields(info))
    return cfg


def deduce_max_seq_len(max_position_embeddings: Optional[int], rope_scaling: Optional[dict]) -> int:
    """builder._init_max_seq_len: max_position_embeddings (2048 if null), times the rope factor rounded up
    (``math.ceil``) unless the rope type's factor does not extend the window (su, longrope, llama3)."""
    base = max_position_embeddings or 2048
    scaling = rope_scaling or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = scaling.get("factor", 1.0) if kind not in _NO_FACTOR_ROPE else 1
    if isinstance(factor, (int, float)) and factor and factor != 1:
        return int(math.ceil(base * factor))
    return int(base)
