"""The TensorRT-LLM checkpoint facts the engine stage needs, from a real checkpoint or predicted from the recipe.

Before conversion (``trtpipe validate``, ``trtpipe plan``) there is no checkpoint ``config.json`` yet, so
:func:`predicted_checkpoint_config` writes the subset of one (docs/reference/trtllm-checkpoint.md#configjson) that the
build config and the planner read, from the Hugging Face config and the recipe. After conversion the real file is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from trtpipe.errors import CheckpointError, EngineError
from trtpipe.jsonfile import read_json
from trtpipe.models.dims import ModelDims
from trtpipe.models.trtllm_config import deduce_max_seq_len
from trtpipe.recipe.schema import Recipe


def predicted_checkpoint_config(info: ModelDims, recipe: Recipe) -> dict[str, Any]:
    """The checkpoint ``config.json`` the checkpoint/quantize stages will write for this recipe.

    Made by the same functions those stages use (the converter's config writer and the quantization layouts
    table), so a plan made before conversion describes exactly the checkpoint that conversion produces.
    """
    from trtpipe.models import get_family
    from trtpipe.models.trtllm_config import build_config, resolve_dtype
    from trtpipe.checkpoint.quant_layouts import quantization_config

    p, q = recipe.parallel, recipe.quantization
    try:
        family = get_family(info.architecture)
        dtype = resolve_dtype(recipe.model.dtype, info.torch_dtype)
    except CheckpointError as exc:
        raise EngineError(str(exc)) from None
    cfg = build_config(info, family, dtype, p.tp, p.pp, p.moe_tp, p.moe_ep, attention_dp=p.attention_dp)
    if q.algo != "none" or q.kv_cache != "none":
        cfg["quantization"] = quantization_config(q.algo, q.kv_cache, q.group_size, q.exclude)
    if recipe.target == "llmapi" and (q.algo != "none" or q.kv_cache != "none"):  # the unified HF format's algo
        from trtpipe.export.formats import hf_quant_config

        cfg["quantization"] = hf_quant_config(q.algo, q.kv_cache, q.group_size, list(q.exclude), {})["quantization"]
    if q.algo == "none":  # a pre-quantized source: its weights are planned in the format they are built in
        imported = _imported_quantization(recipe, info)
        if imported is not None:
            if q.kv_cache != "none":
                imported["kv_cache_quant_algo"] = cfg["quantization"]["kv_cache_quant_algo"]
            cfg["quantization"] = imported
    if _options_kv_fp8(recipe):  # llmapi.options' kv_cache_config.dtype: fp8 overrides the checkpoint's KV algo
        from trtpipe.export.formats import hf_quant_config

        quant = (
            cfg.get("quantization") or hf_quant_config("none", "fp8", q.group_size, list(q.exclude), {})["quantization"]
        )
        cfg["quantization"] = {**quant, "kv_cache_quant_algo": "FP8"}
    if recipe.target == "llmapi":  # what the PyTorch backend's model of this family holds (Family.llmapi_*)
        cfg["use_parallel_embedding"] = cfg.get("use_parallel_embedding", False) or (
            family.llmapi_vocab_parallel and p.tp > 1 and not p.attention_dp
        )
        if family.llmapi_router_in_model_dtype:
            cfg["router_dtype"] = dtype
    return cfg


def _options_kv_fp8(recipe: Recipe) -> bool:
    """``llmapi.options`` sets ``kv_cache_config.dtype: fp8``: TensorRT-LLM then runs an FP8 KV cache whatever the
    checkpoint says (``KvCacheConfig.dtype``: "'fp8', 'fp8_ds_mla', or 'nvfp4' override it explicitly",
    ``tensorrt_llm/llmapi/llm_args.py@0004396720054fd8e205cbf616f21f0b57c6b412``), so the plan counts FP8 KV."""
    if recipe.target != "llmapi":
        return False
    kv = recipe.llmapi.options.get("kv_cache_config")
    return isinstance(kv, dict) and str(kv.get("dtype", "")).lower() == "fp8"


def _imported_quantization(recipe: Recipe, info: ModelDims) -> Optional[dict[str, Any]]:
    """The ``quantization`` a pre-quantized source's checkpoint gets for the recipe's target (None: the source is
    not pre-quantized, keeps its quantized modules as its family ships them, or the target refuses it)."""
    from trtpipe.quant.imported.rules import source_format
    from trtpipe.quant.imported.trtllm import converted_quantization

    fmt = source_format(recipe, info)
    if fmt is None or fmt.quant_algo is None or not fmt.action(recipe.target).ok:
        return None
    if recipe.target == "engine":
        return converted_quantization(fmt)
    # llmapi: the unified HF checkpoint holds the source's algorithm as is or re-laid out into it
    return {
        "quant_algo": fmt.quant_algo,
        "kv_cache_quant_algo": fmt.kv_cache,
        **({"group_size": fmt.group_size} if fmt.group_size else {}),
    }


def read_checkpoint_config(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / "config.json"
    cfg = read_json(path, f"{ckpt_dir} a TensorRT-LLM checkpoint", EngineError)
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
    """trtllm-build's default max_seq_len for a checkpoint config.json (see :func:`deduce_max_seq_len`)."""
    return deduce_max_seq_len(cfg.get("max_position_embeddings"), cfg.get("rotary_scaling"))
