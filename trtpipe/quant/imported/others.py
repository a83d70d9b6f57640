"""fbgemm FP8 (converted for the engine target), FP8 block-scaled and MXFP4 (refused there, passed through for llmapi).

fbgemm FP8 (Meta's Llama-3.1-405B-Instruct-FP8; ``transformers==4.57.1:transformers/integrations/fbgemm_fp8.py``,
``FbgemmFp8Linear``): ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` F32 ``[out, 1]``, ``W = q * weight_scale``
row-wise; activations quantized per token at run time with the upper bound ``activation_scale_ub``. That is
FP8_PER_CHANNEL_PER_TOKEN exactly (:func:`fbgemm_canonical`: codes as is, scale ``[out, 1] -> [out]``), which is
what TensorRT-LLM's ``convert_checkpoint.py`` makes of it (``update_quant_config_from_hf``: ``quant_algo =
FP8_PER_CHANNEL_PER_TOKEN``, ``clamp_val = [-ub, ub]``; ``postprocess_fp8_rowwise`` concatenates codes and scales,
no requantization: NVIDIA/TensorRT-LLM@2a9abd95:tensorrt_llm/quantization/functional.py).

Block-scaled FP8 and MXFP4: TensorRT-LLM 1.2's engine path quantizes a model with ``quantize()``
(NVIDIA/TensorRT-LLM@89fd9b74:tensorrt_llm/quantization/quantize.py), which dispatches FP8 per tensor, FP8 rowwise,
QServe W4A8, NVFP4, SmoothQuant and weight-only layers: there is no block-scaled FP8 or MXFP4 layer to load them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.formats import CONVERTED, PASSED, REFUSED, Action, ImportedFormat

NOT_YET = "trtpipe does not convert {name} checkpoints yet"


FBGEMM_UB = 1200.0  # transformers' FbgemmFp8Config default activation_scale_ub, as upstream's converter reads it
NO_ENGINE_LAYER = (
    "TensorRT-LLM 1.2's engine quantize() has no {what} layer (FP8 per tensor, FP8 rowwise, NVFP4, "
    "SmoothQuant and weight-only only)"
)


def parse_fbgemm(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    ub = qc.get("activation_scale_ub", FBGEMM_UB)
    if isinstance(ub, bool) or not isinstance(ub, (int, float)) or ub <= 0:
        raise CheckpointError(
            f"{where}: quantization_config.activation_scale_ub is {ub!r}, a positive number is needed"
        )
    llmapi = Action(REFUSED, "trtpipe does not re-lay out fbgemm FP8 checkpoints for llmapi yet; use target: engine")
    return ImportedFormat(
        "fbgemm_fp8",
        "FP8 rowwise",
        "FP8_PER_CHANNEL_PER_TOKEN",
        8,
        None,
        "per-channel",
        tuple(qc.get("modules_to_not_convert") or ()),
        None,
        Action(CONVERTED, "via FP8_PER_CHANNEL_PER_TOKEN"),
        llmapi,
        where,
        {"clamp_val": [-float(ub), float(ub)]},
    )


def fbgemm_canonical(
    fmt: ImportedFormat, t: dict[str, torch.Tensor], module: str, where: str, out_f: int, in_f: int
) -> dict[str, torch.Tensor]:
    """One fbgemm FP8 projection -> ModelOpt FP8_PER_CHANNEL_PER_TOKEN tensors (codes as is, scale ``[out]`` F32)."""
    extra = set(t) - {"weight", "weight_scale", "bias"}
    if extra:
        raise CheckpointError(f"{where}: tensor '{module}.{sorted(extra)[0]}' is not part of fbgemm FP8")
    for k in ("weight", "weight_scale"):
        if k not in t:
            raise CheckpointError(f"{where}: tensor '{module}.{k}' is missing (fbgemm FP8)")
    return {**t, "weight_scale": t["weight_scale"].float().reshape(-1)}


def parse_fp8(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    block = qc.get("weight_block_size")
    if block is None:
        why = NOT_YET.format(name="'fp8' (no weight_block_size)")
        return ImportedFormat(
            "fp8",
            "FP8",
            None,
            8,
            None,
            "per-tensor",
            tuple(qc.get("modules_to_not_convert") or ()),
            None,
            Action(REFUSED, why),
            Action(REFUSED, why),
            where,
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size is {block!r}, two positive integers needed"
        )
    engine = Action(REFUSED, NO_ENGINE_LAYER.format(what="block-scaled FP8") + "; use target: llmapi")
    llmapi = (
        Action(PASSED)
        if block == [128, 128]
        else Action(REFUSED, f"TensorRT-LLM 1.2 loads FP8 block scales of [128, 128] only (AssertionError for {block})")
    )
    return ImportedFormat(
        "fp8_block",
        f"FP8 block {block[0]}x{block[1]}",
        "FP8_BLOCK_SCALES",
        8,
        None,
        "block",
        tuple(qc.get("modules_to_not_convert") or ()),
        None,
        engine,
        llmapi,
        where,
    )


def parse_mxfp4(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    engine = Action(REFUSED, NO_ENGINE_LAYER.format(what="MXFP4") + "; use target: llmapi")
    return ImportedFormat(
        "mxfp4",
        "MXFP4 experts",
        None,
        4,
        32,
        "group",
        tuple(qc.get("modules_to_not_convert") or ()),
        None,
        engine,
        Action(PASSED),
        where,
    )
