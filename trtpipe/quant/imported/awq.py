"""AutoAWQ GEMM checkpoints (AutoAWQ, GPTQModel's AWQ ``gemm`` format): zero-point INT4 re-laid out exactly as W4A16
AWQ codes and scales plus the canonical ``zero_point`` (:mod:`.canonical`), for the engine target.

Per Linear (``autoawq==0.2.9:awq/modules/linear/gemm.py``, ``WQLinear_GEMM``): ``qweight`` int32 ``[in, out/8]``
(8 unsigned codes per word along the **output**; nibble slot ``i`` (bits ``4i``) of word ``c`` holds output
``8c + AWQ_ORDER[i]``, ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``), ``qzeros`` int32 ``[in/g, out/8]`` (zero points
0..15, same packing), ``scales`` fp16 ``[in/g, out]``. Dequantization (``awq/utils/packing_utils.py::
dequantize_gemm``): ``W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]``. Every AutoAWQ GEMM checkpoint has zero
points (its symmetric branch cannot write one). The re-layout: signed codes ``q - 8`` two output rows per byte,
``weight_scale = s^T``, ``zero_point = z^T - 8``: ``(q - 8) - (z - 8) = q - z``, nothing rounded.

TensorRT-LLM's own converter reads the same tensors (``USE_HF_AWQ`` in ``postprocess_weight_only_groupwise``,
NVIDIA/TensorRT-LLM@2a9abd95:tensorrt_llm/quantization/functional.py, unpacking with the reorder
``[0, 4, 1, 5, 2, 6, 3, 7]``) but writes W4A16_GPTQ, whose weights it preprocesses for the converting GPU.
GEMV / GEMV_FAST / Marlin packings are refused (upstream unpacks only the GEMM interleave).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtpipe.formats.primitives import pack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.formats.dequant import unpack_awq_words
from trtpipe.quant.imported.canonical import check_stored
from trtpipe.quant.imported.formats import CONVERTED, REFUSED, Action, ImportedFormat

KNOWN = {"qweight", "qzeros", "scales", "bias"}
LLMAPI = Action(
    REFUSED,
    "TensorRT-LLM 1.2's PyTorch backend loads no AutoAWQ checkpoint (its W4A16_AWQ kernel has "
    "no zero point); use target: engine, or a ModelOpt W4A16_AWQ checkpoint",
)


def _int(qc: dict, key: str, where: str, default=None) -> int:
    v = qc.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointError(f"{where}: quantization_config.{key} is {v!r}, an integer is needed")
    return v


def parse(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    bits, group = _int(qc, "bits", where, 4), _int(qc, "group_size", where, 128)
    version = str(qc.get("version", "gemm")).lower()
    zero = bool(qc.get("zero_point", True))
    exclude = tuple(qc.get("modules_to_not_convert") or ())
    if version != "gemm":
        engine = Action(REFUSED, f"AutoAWQ version '{version}' is not unpacked by TensorRT-LLM (GEMM only)")
    elif bits != 4 or group < 1:
        engine = Action(REFUSED, f"AutoAWQ with bits {bits}, group_size {group} is not imported (4-bit groups only)")
    else:
        engine = Action(CONVERTED, "via W4A16_AWQ with zero points")
    # every GEMM checkpoint carries qzeros (zero_point: false cannot be written by AutoAWQ), so they are always kept
    return ImportedFormat(
        "awq",
        f"AutoAWQ {version}" + (" asymmetric" if zero else ""),
        "W4A16_AWQ" if engine.ok else None,
        bits,
        group,
        "group",
        exclude,
        None,
        engine,
        LLMAPI,
        where,
        {"zero_point": True},
    )


def canonical(
    fmt: ImportedFormat, t: dict[str, torch.Tensor], module: str, where: str, out_f: int, in_f: int
) -> dict[str, torch.Tensor]:
    """One AutoAWQ GEMM projection -> W4A16_AWQ tensors with ``zero_point``, exactly (or a refusal naming the
    tensor)."""
    what = f"{where}: tensor '{module}"
    g = fmt.group_size
    if out_f % 8 or in_f % g:
        raise CheckpointError(f"{what}.qweight': [{out_f}, {in_f}] does not pack into 8-code words with group {g}")
    want = {
        "qweight": ((in_f, out_f // 8), torch.int32),
        "qzeros": ((in_f // g, out_f // 8), torch.int32),
        "scales": ((in_f // g, out_f), None),
    }
    check_stored(t, KNOWN, ("qweight", "qzeros", "scales"), want, f"AutoAWQ GEMM group {g}", what, out_f, in_f)
    if t["qweight"].device.type == "meta":
        return {
            "weight": torch.empty(out_f // 2, in_f, dtype=torch.uint8, device="meta"),
            "weight_scale": torch.empty(out_f, in_f // g, device="meta"),
            "zero_point": torch.empty(out_f, in_f // g, dtype=torch.int8, device="meta"),
        }
    if "bias" in t and bool(t["bias"].any()):
        raise CheckpointError(f"{what}.bias' is not zero; biases of quantized projections are not imported")
    q = (unpack_awq_words(t["qweight"]) - 8).to(torch.int8).t().contiguous()  # [out, in], -8..7
    z = (unpack_awq_words(t["qzeros"]) - 8).to(torch.int8).t().contiguous()  # [out, in/g], -8..7
    return {
        "weight": pack_int4_rows(q).view(torch.uint8),
        "weight_scale": t["scales"].float().t().contiguous(),
        "zero_point": z,
    }
