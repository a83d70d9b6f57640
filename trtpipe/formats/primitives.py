"""Quantization as pure tensor functions: observe -> choose_qparams -> quantize / dequantize, plus int4 packing.

One ``granularity`` argument covers every layout TensorRT-LLM uses (torchao's ``block_size`` idea):

* ``"tensor"``   one scale for the whole tensor, shape ``[1]``            (FP8 weights and activations)
* ``"channel"``  one scale per output row, shape ``[out]``                (INT8 SmoothQuant / weight-only)
* ``int g``      one scale per row and group of g input columns, ``[out, in/g]``  (INT4 AWQ; stacked experts
                 ``[E, out, in]``: ``[E, out, in/g]``, each expert as a linear of its own)
* ``"expert"``   one scale per expert of a stacked ``[E, out, in]`` weight, shape ``[E, 1]``   (FP8 MoE)

Scales are *dequantization* scales (real ~= code * scale) = amax / qmax, as TRT-LLM stores them
(docs/reference/trtllm-checkpoint.md#quantized-tensors).
Packing is a separate step: :func:`pack_int4_rows` / :func:`unpack_int4_rows`.

NVFP4 (two-level: E2M1 codes, an FP8 E4M3 scale per block of 16 inputs, one F32 global scale) has its own
functions: :func:`e2m1_codes`, :func:`nvfp4_block_scales`, :func:`nvfp4_quantize` and :func:`nvfp4_dequantize`
(weights, packed two codes per byte along the input, low nibble = even column) and :func:`nvfp4_fake_quant`
(activations, dynamic block scales under the static global ``input_scale``). The unified-HF writer and every reader
of NVFP4 (the unified-HF runtime loader and the TensorRT-LLM checkpoint loader) call these, so a source and its
engine re-layout dequantize identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

Granularity = Union[str, int]


@dataclass(frozen=True)
class Format:
    """A number format: its code dtype, the largest code, and whether codes are integers (rounded)."""

    name: str
    dtype: torch.dtype
    qmax: float
    integer: bool


FORMATS: dict[str, Format] = {
    "fp8": Format("fp8", torch.float8_e4m3fn, 448.0, False),
    "int8": Format("int8", torch.int8, 127.0, True),
    "int4": Format("int4", torch.int8, 7.0, True),  # stored one code per int8 until packed
}
_INT_MIN = {"int8": -128, "int4": -8}


def _grouped(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """View ``x`` [out, in] as [out, in/g, g] (group; [..., out, in/g, g] with leading expert axes), [out, 1, in]
    (channel) or [1, 1, numel] (tensor)."""
    if granularity == "tensor":
        return x.reshape(1, 1, -1)
    if granularity == "expert":
        return x.reshape(x.shape[0], 1, -1)
    if granularity == "channel":
        return x.reshape(x.shape[0], 1, -1)
    g = int(granularity)
    if x.shape[-1] % g:
        raise ValueError(f"in_features {x.shape[-1]} is not a multiple of group size {g}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def observe_amax(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Absolute maximum at ``granularity`` (float32): ``[1]``, ``[out]``, ``[out, in/g]`` or ``[E, 1]``."""
    amax = _grouped(x.detach().float(), granularity).abs().amax(dim=-1)
    return amax.reshape(1) if granularity == "tensor" else amax.squeeze(1) if granularity == "channel" else amax


def observe_channel_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-input-channel absolute maximum of activations ``[..., in]`` -> ``[in]`` (float32)."""
    return x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()


def choose_qparams(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """Dequantization scale amax/qmax (float32). A zero amax gets scale 1 so codes stay 0, never NaN."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FORMATS[fmt].qmax, torch.ones_like(amax))


def _expand(scale: torch.Tensor, x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Broadcast a scale of any granularity to ``x``'s shape."""
    if granularity == "tensor":
        return scale.reshape(()).expand_as(x)
    if granularity == "expert":
        return scale.reshape(-1, *([1] * (x.dim() - 1))).expand_as(x)
    if granularity == "channel":
        return scale.reshape(-1, 1).expand_as(x)
    return scale.repeat_interleave(int(granularity), dim=-1)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str, granularity: Granularity) -> torch.Tensor:
    """Codes of ``x`` for ``scale``: round-to-nearest-even and clamp for integers, saturating cast for FP8."""
    f = FORMATS[fmt]
    y = x.float() / _expand(scale.float(), x, granularity)
    if f.integer:
        return y.round().clamp(_INT_MIN[fmt], f.qmax).to(f.dtype)
    return y.clamp(-f.qmax, f.qmax).to(f.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, granularity: Granularity) -> torch.Tensor:
    """float32 values ``q * scale``."""
    return q.float() * _expand(scale.float(), q, granularity)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-tensor quantize-dequantize of activations, as a static-scale TRT-LLM kernel sees them (x's dtype)."""
    return dequantize(quantize(x, scale, fmt, "tensor"), scale, fmt, "tensor").to(x.dtype)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 codes ``[out, in]`` (int8 in -8..7) into ``[out/2, in]`` int8: pairs of consecutive OUTPUT rows,
    the even row in the low nibble (``byte = (q[2k] & 0xF) | (q[2k+1] << 4)``), as ModelOpt and TRT-LLM use it.
    Stacked experts ``[E, out, in]`` are packed one expert at a time (``[E, out/2, in]``)."""
    if q.shape[-2] % 2:
        raise ValueError(f"cannot pack int4: {q.shape[-2]} output rows is odd")
    lo, hi = q[..., 0::2, :].to(torch.int16), q[..., 1::2, :].to(torch.int16)
    packed = (lo & 0xF) | ((hi & 0xF) << 4)
    return packed.to(torch.uint8).view(torch.int8)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: ``[..., out/2, in]`` int8 -> ``[..., out, in]`` int8 codes in -8..7."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    out = torch.stack([lo, hi], dim=-2)  # [..., out/2, 2, in]: row 2k then 2k+1
    return out.reshape(*packed.shape[:-2], -1, packed.shape[-1]).to(torch.int8)


E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_BLOCK = 16


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit E2M1 codes (sign bit 3), round to nearest, ties to the even code (ModelOpt's _cast_fp4)."""
    a = x.abs()
    code = torch.searchsorted(E2M1_BOUNDS, a.contiguous(), right=False).to(torch.uint8)
    code += (a.unsqueeze(-1) == E2M1_BOUNDS[[1, 3, 5]]).any(-1).to(torch.uint8)  # 0.75, 1.75, 3.5 round up
    return ((x < 0).to(torch.uint8) << 3) + code


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (any integer dtype, bit 3 = sign) -> float32 values."""
    codes = codes.long()
    return E2M1_VALUES[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)


def nvfp4_block_scales(w: torch.Tensor, wsf2: torch.Tensor) -> torch.Tensor:
    """Per-16 block scales [out, in/16] as FP8: amax_block / (6 * wsf2), zero -> 1, clamped to [2^-9, 448]."""
    amax = w.float().reshape(w.shape[0], -1, NVFP4_BLOCK).abs().amax(-1)
    s = amax / (6.0 * wsf2.float())
    s[s == 0] = 1.0
    return s.clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)


def nvfp4_quantize(w: torch.Tensor, wsf2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (U8 [out, in/2] E2M1 pairs, low nibble = even column; FP8 [out, in/16] block scales) under
    the second-level scale ``wsf2`` (the inverse of :func:`nvfp4_dequantize`)."""
    bs = nvfp4_block_scales(w, wsf2)
    scaled = w.float().reshape(w.shape[0], -1, NVFP4_BLOCK) / (bs.float() * wsf2.float()).unsqueeze(-1)
    q = e2m1_codes(scaled.reshape(w.shape))
    return ((q[:, 1::2] << 4) | q[:, 0::2]).contiguous(), bs


def nvfp4_dequantize(packed: torch.Tensor, block_scale: torch.Tensor, wsf2: torch.Tensor) -> torch.Tensor:
    """U8 [out, in/2] E2M1 pairs (low nibble = even column) x FP8 [out, in/16] x F32 scalar -> float32 [out, in]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    vals = e2m1_values(codes)
    scale = block_scale.float() * wsf2.float().reshape(())
    return (vals.reshape(vals.shape[0], -1, NVFP4_BLOCK) * scale.unsqueeze(-1)).reshape(vals.shape)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Activations ``[..., in]`` through NVFP4 as the FP4 GEMM receives them: per 16-input block an FP8 scale
    ``amax / (6 * global_scale)`` (dynamic), E2M1 codes under it; computed in float32, returned in x's dtype."""
    gs = global_scale.float().reshape(())
    shape = x.shape
    flat = x.float().reshape(-1, shape[-1])
    bs = nvfp4_block_scales(flat, gs).float() * gs
    blocks = flat.reshape(flat.shape[0], -1, NVFP4_BLOCK)
    xq = e2m1_values(e2m1_codes(blocks / bs.unsqueeze(-1))) * bs.unsqueeze(-1)
    return xq.reshape(shape).to(x.dtype)
