"""The TensorRT-LLM checkpoint facts the engine stage needs, from a real checkpoint or predicted from the recipe.

Before conversion (``trtpipe validate``, ``trtpipe plan``) there is no checkpoint ``config.json`` yet, so
:func:`predicted_checkpoint_config` writes the subset of one (contract §1.2–1.4) that the build config and
the planner read, from the Hugging Face config and the recipe. After conversion the real file is used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from trtpipe.errors import EngineError
from trtpipe.models.hfconfig import HFModelInfo
from trtpipe.recipe.schema import Recipe

# recipe quantization.algo -> checkpoint quant_algo (modelopt export names, contract §1.4)
QUANT_ALGO = {
    "none": None,
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
}
KV_CACHE_QUANT_ALGO = {"none": None, "fp8": "FP8", "int8": "INT8"}
# rope scaling types whose factor does not extend max_position_embeddings (contract §4.1, --max_seq_len)
_NO_FACTOR_ROPE = ("su", "longrope", "llama3")


def model_dtype(recipe_dtype: str, source_dtype: str) -> str:
    """``auto`` follows TensorRT-LLM: float32 sources become float16, others keep their dtype."""
    if recipe_dtype != "auto":
        return recipe_dtype
    return "float16" if source_dtype in ("float32", "float", "torch.float32") else source_dtype.replace("torch.", "")


def predicted_checkpoint_config(info: HFModelInfo, recipe: Recipe) -> dict[str, Any]:
    """The checkpoint ``config.json`` fields trtpipe reads, as the converter will write them for this recipe."""
    p = recipe.parallel
    q = recipe.quantization
    cfg: dict[str, Any] = {
        "architecture": info.architecture,
        "dtype": model_dtype(recipe.model.dtype, info.torch_dtype),
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_size": info.head_dim,
        "intermediate_size": info.intermediate_size,
        "hidden_act": "swiglu" if info.is_moe else info.hidden_act,
        "max_position_embeddings": info.max_position_embeddings,
        "rotary_scaling": info.rope_scaling,
        "tie_word_embeddings": info.tie_word_embeddings,
        "mapping": {"world_size": p.world_size, "tp_size": p.tp, "pp_size": p.pp},
        "quantization": {
            "quant_algo": QUANT_ALGO[q.algo],
            "kv_cache_quant_algo": KV_CACHE_QUANT_ALGO[q.kv_cache],
            "group_size": q.group_size,
        },
    }
    if info.is_moe:
        from trtpipe.recipe.rules import resolve_moe_sizes

        ep, mtp = resolve_moe_sizes(p.tp, p.moe_ep, p.moe_tp)
        cfg["moe"] = {"num_experts": info.num_experts, "top_k": info.experts_per_token}
        cfg["mapping"].update(moe_ep_size=ep, moe_tp_size=mtp)
    return cfg


def read_checkpoint_config(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: not found (is {ckpt_dir} a TensorRT-LLM checkpoint?)") from None
    except json.JSONDecodeError as exc:
        raise EngineError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    for key in ("architecture", "dtype", "num_hidden_layers", "num_attention_heads", "hidden_size"):
        if key not in cfg:
            raise EngineError(f"{path}: required key '{key}' is missing")
    return cfg


def quant(cfg: dict) -> tuple[Optional[str], Optional[str]]:
    q = cfg.get("quantization") or {}
    return q.get("quant_algo"), q.get("kv_cache_quant_algo")


def mapping(cfg: dict) -> tuple[int, int]:
    m = cfg.get("mapping") or {}
    return int(m.get("tp_size", 1)), int(m.get("pp_size", 1))


def deduced_max_seq_len(cfg: dict) -> int:
    """trtllm-build's default max_seq_len: max_position_embeddings (2048 if null) x the rope factor."""
    base = cfg.get("max_position_embeddings") or 2048
    scaling = cfg.get("rotary_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    factor = scaling.get("factor", 1.0) if kind not in _NO_FACTOR_ROPE else 1.0
    return int(base * (factor or 1.0))
