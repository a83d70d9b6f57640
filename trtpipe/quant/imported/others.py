"""Formats recognised but not (yet) converted by trtpipe: AutoAWQ, fbgemm FP8, FP8 block-scaled, MXFP4.

Each is described in one line and, per target, refused with the reason and the alternative, so a recipe fails at
``trtpipe validate`` instead of converting wrong numbers. The reasons are TensorRT-LLM 1.2 facts where one decides
(the PyTorch backend's W4A16 AWQ kernel has no zero point; block-scaled FP8 and MXFP4 have no engine layer) and
trtpipe's own limits otherwise (said so).
"""

from __future__ import annotations

from pathlib import Path

from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.formats import PASSED, REFUSED, Action, ImportedFormat

NOT_YET = "trtpipe does not convert {name} checkpoints yet"


def _int(qc: dict, key: str, where: str, default=None) -> int:
    v = qc.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"{where}: quantization_config.{key} is {v!r}, an integer is needed")
    return v


def parse_awq(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    bits, group = _int(qc, "bits", where, 4), _int(qc, "group_size", where, 128)
    version = str(qc.get("version", "gemm")).lower()
    zero = bool(qc.get("zero_point", True))
    exclude = tuple(qc.get("modules_to_not_convert") or ())
    llmapi = Action(REFUSED, "TensorRT-LLM 1.2's PyTorch backend loads no AutoAWQ checkpoint (its W4A16_AWQ kernel has "
                             "no zero point); use target: engine once supported, or a ModelOpt W4A16_AWQ checkpoint")
    if version != "gemm":
        engine = Action(REFUSED, f"AutoAWQ version '{version}' is not unpacked by TensorRT-LLM (GEMM only)")
    else:
        engine = Action(REFUSED, NOT_YET.format(name="AutoAWQ GEMM") + " (W4A16_GPTQ with zero points, preprocessed "
                                 "per GPU); run TensorRT-LLM's convert_checkpoint.py on the target GPU")
    return ImportedFormat("awq", f"AutoAWQ {version}" + (" asymmetric" if zero else ""), None, bits, group, "group",
                          exclude, None, engine, llmapi, where)


def parse_fbgemm(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    why = NOT_YET.format(name="fbgemm FP8") + "; TensorRT-LLM's convert_checkpoint.py reads it as FP8_PER_CHANNEL_PER_TOKEN"
    return ImportedFormat("fbgemm_fp8", "FP8 rowwise", "FP8_PER_CHANNEL_PER_TOKEN", 8, None, "per-channel",
                          tuple(qc.get("modules_to_not_convert") or ()), None, Action(REFUSED, why),
                          Action(REFUSED, why), where)


def parse_fp8(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    block = qc.get("weight_block_size")
    if block is None:
        why = NOT_YET.format(name="'fp8' (no weight_block_size)")
        return ImportedFormat("fp8", "FP8", None, 8, None, "per-tensor", tuple(qc.get("modules_to_not_convert") or ()),
                              None, Action(REFUSED, why), Action(REFUSED, why), where)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size is {block!r}, two positive integers needed")
    engine = Action(REFUSED, "block-scaled FP8 has no TensorRT-engine layer in TensorRT-LLM 1.2; use target: llmapi")
    llmapi = Action(PASSED) if block == [128, 128] else Action(
        REFUSED, f"TensorRT-LLM 1.2 loads FP8 block scales of [128, 128] only (AssertionError for {block})")
    return ImportedFormat("fp8_block", f"FP8 block {block[0]}x{block[1]}", "FP8_BLOCK_SCALES", 8, None, "block",
                          tuple(qc.get("modules_to_not_convert") or ()), None, engine, llmapi, where)


def parse_mxfp4(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    engine = Action(REFUSED, "MXFP4 has no TensorRT-engine layer in TensorRT-LLM 1.2 (a PyTorch-backend model); "
                             "use target: llmapi")
    return ImportedFormat("mxfp4", "MXFP4 experts", None, 4, 32, "group",
                          tuple(qc.get("modules_to_not_convert") or ()), None, engine, Action(PASSED), where)
