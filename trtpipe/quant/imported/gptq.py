"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): 4-bit ones re-laid out exactly as W4A16 AWQ (with zero points
where the checkpoint is asymmetric).

Per Linear (``gptqmodel==7.7.0:gptqmodel/nn_modules/qlinear/__init__.py``): ``qweight`` int32 ``[in/8, out]``
(element j of word row r is input row 8r + j at bits 4j, unsigned), ``qzeros`` int32 ``[in/g, out/8]`` (zero points
along the output, same bit order), ``scales`` fp16 ``[in/g, out]``, ``g_idx`` int32 ``[in]``. Dequantization:
``W[o, i] = s[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])``, with the stored words ``z - 0x11111111`` in the v1
format (``checkpoint_format: gptq``; GPTQModel subtracts that from each int32 word on save and adds it back on
load, borrows included, so a true zero of 0 survives; every 4-bit symmetric v1 word is 0x77777777) and ``z``
itself in ``gptq_v2``.

With contiguous groups (``g_idx[i] == i // g``, also under act-order when it holds) that is ModelOpt's W4A16 AWQ
layout with unit pre-quant scales: signed codes ``q - 8``, two output rows per byte, ``weight_scale = scales^T``,
and for ``sym: false`` the canonical ``zero_point = z - 8`` (:mod:`.canonical`). That is the re-layout (portable:
``trtllm-build`` preprocesses it per GPU). Refused naming the tensor: zeros that are not 8 in a ``sym: true``
checkpoint, a non-contiguous ``g_idx`` (TensorRT-LLM's kernels have no g_idx), 8-bit or other widths, non-zero
biases where the architecture has none. All-zero biases (some exporters write one on every Linear) are dropped.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trtpipe.formats.primitives import pack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.formats.dequant import GPTQ_V1_ZERO_OFFSET, unpack_int32
from trtpipe.quant.imported.canonical import check_stored
from trtpipe.quant.imported.formats import CONVERTED, REFUSED, RELAID, Action, ImportedFormat

KNOWN = {"qweight", "qzeros", "scales", "g_idx", "bias"}
NO_ZERO_POINT = (
    "TensorRT-LLM 1.2's PyTorch W4A16_AWQ kernel has no zero point (zeros=None); use target: engine, "
    "or a symmetric checkpoint"
)


def parse(model_dir: Path, qc: dict, where: str) -> ImportedFormat:
    def num(key, default):
        v = qc.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            raise CheckpointError(f"{where}: quantization_config.{key} is {v!r}, an integer is needed")
        return v

    bits, group = num("bits", 4), num("group_size", 128)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq")))
    sym, act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    name = f"{fmt}" + (" symmetric" if sym else " asymmetric") + (" act-order" if act else "")
    refusal = None
    if bits != 4:
        refusal = f"GPTQ {bits}-bit is not imported (4-bit only)"
    elif fmt not in ("gptq", "gptq_v2"):
        refusal = f"GPTQ checkpoint_format '{fmt}' is not imported (gptq, gptq_v2)"
    elif group < 1:
        refusal = "GPTQ per-channel (group_size -1) is not imported"
    if refusal:
        engine = llmapi = Action(REFUSED, refusal)
    elif not sym:
        engine, llmapi = Action(CONVERTED, "via W4A16_AWQ with zero points"), Action(REFUSED, NO_ZERO_POINT)
    else:
        engine, llmapi = Action(CONVERTED, "via W4A16_AWQ"), Action(RELAID, "ModelOpt W4A16_AWQ")
    return ImportedFormat(
        "gptq",
        name,
        "W4A16_AWQ" if refusal is None else None,
        bits,
        group if group > 0 else None,
        "group",
        tuple(qc.get("modules_to_not_convert") or ()),
        None,
        engine,
        llmapi,
        where,
        {"v1": fmt == "gptq", "zero_point": not sym, "act_order": act},
    )


def canonical(
    fmt: ImportedFormat, t: dict[str, torch.Tensor], module: str, where: str, out_f: int, in_f: int
) -> dict[str, torch.Tensor]:
    """One GPTQ projection -> ModelOpt W4A16_AWQ tensors, exactly (or a refusal naming the tensor)."""
    what = f"{where}: tensor '{module}"
    g = fmt.group_size
    if in_f % 8 or out_f % 8 or in_f % g:
        raise CheckpointError(f"{what}.qweight': [{out_f}, {in_f}] does not pack into 8-code words with group {g}")
    want = {
        "qweight": ((in_f // 8, out_f), torch.int32),
        "qzeros": ((in_f // g, out_f // 8), torch.int32),
        "scales": ((in_f // g, out_f), None),
        "g_idx": ((in_f,), None),
    }
    check_stored(t, KNOWN, ("qweight", "qzeros", "scales"), want, f"GPTQ {fmt.bits}-bit group {g}", what, out_f, in_f)
    meta = t["qweight"].device.type == "meta"
    if meta:
        out = {
            "weight": torch.empty(out_f // 2, in_f, dtype=torch.uint8, device="meta"),
            "weight_scale": torch.empty(out_f, in_f // g, device="meta"),
        }
        if fmt.params.get("zero_point"):
            out["zero_point"] = torch.empty(out_f, in_f // g, dtype=torch.int8, device="meta")
        return out
    if "g_idx" in t and not torch.equal(t["g_idx"].to(torch.int64), torch.arange(in_f) // g):
        raise CheckpointError(
            f"{what}.g_idx' is not contiguous (act-order groups): TensorRT-LLM's kernels have no "
            "g_idx; re-quantize without desc_act or with static_groups"
        )
    zeros = unpack_int32(true_zero_words(t["qzeros"], fmt.params.get("v1")), 1)  # [in/g, out], 0..15
    if not fmt.params.get("zero_point") and not bool((zeros == 8).all()):
        r, c = (zeros != 8).nonzero()[0].tolist()
        raise CheckpointError(
            f"{what}.qzeros' holds zero point {int(zeros[r, c])} at group {r}, column {c}: not "
            "symmetric (8) as config.json's sym: true says"
        )
    if "bias" in t and bool(t["bias"].any()):
        raise CheckpointError(f"{what}.bias' is not zero; biases of quantized projections are not imported")
    q = (unpack_int32(t["qweight"], 0) - 8).to(torch.int8).t().contiguous()  # [out, in], -8..7
    out = {"weight": pack_int4_rows(q).view(torch.uint8), "weight_scale": t["scales"].float().t().contiguous()}
    if fmt.params.get("zero_point"):
        out["zero_point"] = (zeros - 8).to(torch.int8).t().contiguous()  # [out, in/g], -8..7
    return out


def true_zero_words(qzeros: torch.Tensor, v1: bool) -> torch.Tensor:
    """The qzeros words holding the true zero points: v1 words + 0x11111111 (int32 wraparound, borrows undone),
    as GPTQModel's ``convert_gptq_v1_to_v2_format_module`` does on load."""
    if not v1:
        return qzeros
    w = (qzeros.to(torch.int64) + GPTQ_V1_ZERO_OFFSET) & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
