"""The canonical form every importer re-lays a projection out into: ModelOpt's unified HF tensors, checked.

ModelOpt 0.47.0 ``export_hf_checkpoint`` per HF projection ``P`` (``trtpipe.export.formats`` writes the same):

==========================  ==============  ======================  ============  ===============  ===============
quant_algo                  P.weight        P.weight_scale          P.input_scale P.weight_scale_2 P.pre_quant_scale
==========================  ==============  ======================  ============  ===============  ===============
FP8                         F8_E4M3         [] or [1]               [] or [1]     -                -
FP8_PER_CHANNEL_PER_TOKEN   F8_E4M3         [out] (or [out, 1])     -             -                -
W8A16                       I8              [out] (or [out, 1])     -             -                -
W8A8_SQ_PER_CHANNEL         I8              [out] (or [out, 1])     [] or [1]     -                [in]
W8A8_SQ_PER_CHANNEL_PER_    I8              [out] (or [out, 1])     -             -                -
TOKEN_PLUGIN (no ModelOpt form: compressed-tensors INT8 W8A8, activations dynamic per token)
W4A16_AWQ                   U8 [out/2, in]  [out, in/g]             -             -                [in] (optional)
W4A8_AWQ                    U8 [out/2, in]  [out, in/g]             [] or [1]     [] or [1]        [in] (optional)
NVFP4                       U8 [out, in/2]  F8_E4M3 [out, in/16]    [] or [1]     [] or [1]        -
==========================  ==============  ======================  ============  ===============  ===============

AWQ's pre-quant scale of q/k/v and gate/up is folded into the norm in front of them, so only o_proj / down_proj
carry it (TensorRT-LLM's PyTorch loader reads it there).

Zero-point INT4 (AutoAWQ GEMM, asymmetric GPTQ and compressed-tensors) has no ModelOpt form; it is W4A16_AWQ's
tensors plus ``P.zero_point``, I8 ``[out, in/g]`` (the signed zero of each group, -8..7, in the same signed code
space as the weight's nibbles): ``W = (q - zero_point) * weight_scale``. Only the engine target takes it.

A checkpoint that contradicts this table is refused with the tensor named (:func:`check_projection`), before
anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trtpipe.errors import CheckpointError


@dataclass(frozen=True)
class Layout:
    """One canonical algorithm: the weight's dtype and stored shape, and which scales it has."""

    weight_dtype: torch.dtype
    weight_shape: str  # "full" [out, in], "rows/2" [out/2, in], "cols/2" [out, in/2]
    weight_scale: str  # "scalar", "channel", "group"
    input_scale: bool = False
    weight_scale_2: bool = False
    pre_quant_scale: str = "none"  # "none", "optional", "required"
    block: Optional[int] = None  # a fixed group size (NVFP4: 16)
    zero_point: bool = False  # may carry a per-group zero_point (zero-point INT4)


LAYOUTS: dict[str, Layout] = {
    "FP8": Layout(torch.float8_e4m3fn, "full", "scalar", input_scale=True),
    "FP8_PER_CHANNEL_PER_TOKEN": Layout(torch.float8_e4m3fn, "full", "channel"),
    "W8A16": Layout(torch.int8, "full", "channel"),
    "W8A8_SQ_PER_CHANNEL": Layout(torch.int8, "full", "channel", input_scale=True, pre_quant_scale="required"),
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": Layout(torch.int8, "full", "channel"),
    "W4A16_AWQ": Layout(torch.uint8, "rows/2", "group", pre_quant_scale="optional", zero_point=True),
    "W4A8_AWQ": Layout(
        torch.uint8, "rows/2", "group", input_scale=True, weight_scale_2=True, pre_quant_scale="optional"
    ),
    "NVFP4": Layout(torch.uint8, "cols/2", "group", input_scale=True, weight_scale_2=True, block=16),
}
SCALES = ("weight_scale", "input_scale", "weight_scale_2", "pre_quant_scale", "zero_point")
KV_SCALES = ("k_scale", "v_scale")


def check_stored(
    t: dict[str, torch.Tensor], known: set, required: tuple, want: dict, label: str, what: str, out_f: int, in_f: int
) -> None:
    """A packed source projection's tensors (GPTQ, AutoAWQ): nothing unknown, nothing required missing, and each
    tensor of ``want`` (suffix -> (shape, dtype or None)) present with that shape and dtype; ``what`` is
    ``"<where>: tensor '<module>"``."""
    extra = set(t) - known
    if extra:
        raise CheckpointError(f"{what}.{sorted(extra)[0]}' is not part of {label}")
    for k in required:
        if k not in t:
            raise CheckpointError(f"{what}.{k}' is missing ({label})")
    for k, (shape, dtype) in want.items():
        if k in t and (tuple(t[k].shape) != shape or dtype is not None and t[k].dtype != dtype):
            raise CheckpointError(
                f"{what}.{k}' is {t[k].dtype} {list(t[k].shape)}, {label} of a [{out_f}, {in_f}] "
                f"projection stores {list(shape)}" + (f" {dtype}" if dtype is not None else "")
            )


def stored_weight_shape(layout: Layout, out_f: int, in_f: int) -> tuple[int, int]:
    return {"full": (out_f, in_f), "rows/2": (out_f // 2, in_f), "cols/2": (out_f, in_f // 2)}[layout.weight_shape]


def group_of(layout: Layout, in_f: int, weight_scale_shape: tuple[int, ...], what: str) -> Optional[int]:
    """The group size a group-scaled weight implies (``in / weight_scale.shape[-1]``), checked to divide."""
    if layout.weight_scale != "group":
        return None
    if len(weight_scale_shape) != 2 or weight_scale_shape[-1] == 0 or in_f % weight_scale_shape[-1]:
        raise CheckpointError(
            f"{what}.weight_scale: shape {list(weight_scale_shape)} does not give a group size "
            f"that divides in_features {in_f}"
        )
    return in_f // weight_scale_shape[-1]


def check_projection(
    algo: str,
    module: str,
    tensors: dict[str, torch.Tensor],
    out_f: int,
    in_f: int,
    group_size: Optional[int],
    where: str,
) -> None:
    """Refuse a projection whose tensors contradict ``algo``'s canonical layout (names the tensor and the rule).

    ``tensors`` maps suffixes to tensors (meta tensors are fine: only dtypes and shapes are read).
    """
    lay = LAYOUTS[algo]
    what = f"{where}: tensor '{module}"
    w = tensors.get("weight")
    if w is None:
        raise CheckpointError(f"{what}.weight' is missing ({algo})")
    if w.dtype != lay.weight_dtype:
        raise CheckpointError(f"{what}.weight' is {w.dtype}, {algo} stores {lay.weight_dtype}")
    if lay.weight_shape == "rows/2" and out_f % 2 or lay.weight_shape == "cols/2" and in_f % 2:
        raise CheckpointError(f"{what}.weight': [{out_f}, {in_f}] cannot be packed two 4-bit codes per byte")
    want = stored_weight_shape(lay, out_f, in_f)
    if tuple(w.shape) != want:
        raise CheckpointError(
            f"{what}.weight' has shape {list(w.shape)}, {algo} of a [{out_f}, {in_f}] projection stores {list(want)}"
        )
    ws = tensors.get("weight_scale")
    if ws is None:
        raise CheckpointError(f"{what}.weight_scale' is missing ({algo})")
    shape = tuple(ws.shape)
    if lay.weight_scale == "scalar" and ws.numel() != 1:
        raise CheckpointError(f"{what}.weight_scale' has shape {list(shape)}, {algo} has one scale per tensor")
    if lay.weight_scale == "channel" and shape not in ((out_f,), (out_f, 1)):
        raise CheckpointError(
            f"{what}.weight_scale' has shape {list(shape)}, {algo} has one scale per output row ([{out_f}])"
        )
    if lay.weight_scale == "group":
        g = group_of(lay, in_f, shape, f"{where}: tensor '{module}")
        expected = lay.block or group_size
        if shape[0] != out_f or (expected is not None and g != expected):
            raise CheckpointError(
                f"{what}.weight_scale' has shape {list(shape)}, group size {expected} of a "
                f"[{out_f}, {in_f}] projection needs [{out_f}, {in_f // (expected or g)}]"
            )
    for key, needed in (("input_scale", lay.input_scale), ("weight_scale_2", lay.weight_scale_2)):
        t = tensors.get(key)
        if needed and t is None:
            raise CheckpointError(f"{what}.{key}' is missing ({algo})")
        if t is not None and t.numel() != 1:
            raise CheckpointError(f"{what}.{key}' has shape {list(t.shape)}, {algo} stores one scale per tensor")
    pqs = tensors.get("pre_quant_scale")
    if lay.pre_quant_scale == "required" and pqs is None:
        raise CheckpointError(f"{what}.pre_quant_scale' is missing ({algo})")
    if pqs is not None and (lay.pre_quant_scale == "none" or tuple(pqs.shape) != (in_f,)):
        raise CheckpointError(
            f"{what}.pre_quant_scale' has shape {list(pqs.shape)}, {algo} has "
            + (f"[{in_f}]" if lay.pre_quant_scale != "none" else "none")
        )
    zp = tensors.get("zero_point")
    if zp is not None and (not lay.zero_point or zp.dtype != torch.int8 or tuple(zp.shape) != shape):
        raise CheckpointError(
            f"{what}.zero_point' is {zp.dtype} {list(zp.shape)}, {algo} "
            + (f"zero points are int8 {list(shape)}" if lay.zero_point else "has none")
        )
    extra = set(tensors) - {"weight", "bias", *SCALES, *KV_SCALES}
    if extra:
        raise CheckpointError(f"{what}.{sorted(extra)[0]}' is not part of {algo}")
