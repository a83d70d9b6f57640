"""The weight formats other producers ship, dequantized exactly as each format defines: pure tensor functions.

Each function takes one linear's stored tensors and returns its float32 ``[out, in]`` weight (every value the
exact ``(code - zero) * scale`` of the format, the scale widened to float32 first: nothing is rounded). ``what``
names the module in errors: a tensor whose shape or dtype the format does not allow fails in one line naming
the tensor. Nothing here knows a model; the reference runtime's HF loader (:mod:`trtpipe.runtime.hf_loader`)
calls them per projection, the tests compare them with each producer's own dequantizer.

compressed-tensors' INT4 packing (:func:`pack_int4_to_int32` and its inverse) is here too: the compressed-tensors
writer (:mod:`trtpipe.export.compressed`) and importer read the same functions.

=====================  ==========================================================  ==============================
format                 stored                                                      value
=====================  ==========================================================  ==============================
GPTQ (v1, v2)          ``qweight`` i32 [in/8, out], ``qzeros`` i32 [in/g, out/8],  ``s[g_idx[i], o] *
                       ``scales`` [in/g, out], ``g_idx`` [in] (default ``i // g``)  (q[i, o] - z[g_idx[i], o])``
AutoAWQ GEMM           ``qweight`` i32 [in, out/8], ``qzeros`` i32 [in/g, out/8]    ``s[i // g, o] *
                       (nibble order 0 2 4 6 1 3 5 7), ``scales`` [in/g, out]      (q[i, o] - z[i // g, o])``
compressed-tensors     ``weight_packed`` i32 [out, in/8] (signed codes + 8),       ``s[o, i // g] *
pack-quantized         ``weight_scale`` [out, in/g], ``weight_zero_point`` i32      (q[o, i] - z[o, i // g])``
                       [out/8, in/g] (asymmetric; packed along the output)
compressed-tensors     ``weight`` i8 [out, in], ``weight_scale`` [out, 1]           ``s[o] * q[o, i]``
int-quantized (W8A8)
FP8 block-scaled       ``weight`` F8_E4M3 [out, in], ``weight_scale_inv`` (or       ``s[o // bo, i // bi] *
                       ``weight_scale``) F32 [ceil(out/bo), ceil(in/bi)]            q[o, i]``
fbgemm FP8             ``weight`` F8_E4M3 [out, in], ``weight_scale`` F32 [out, 1]  ``s[o] * q[o, i]``
=====================  ==========================================================  ==============================

Sources of each definition (upstream file at the version pinned in scripts/producers-requirements.txt or the
transformers in the project's venv):

* GPTQ: ``gptqmodel==7.6.0:gptqmodel/nn_modules/qlinear/__init__.py`` (``PackableQuantLinear.dequantize_weight``);
  the v1 format stores ``z - 1`` per nibble and is read back by adding ``0x11111111`` to each int32 word
  (``gptqmodel/utils/model.py::convert_gptq_v1_to_v2_format_module``, carries included).
* AutoAWQ GEMM: ``gptqmodel==7.6.0:gptqmodel/quantization/awq/utils/packing_utils.py`` (``dequantize_gemm``,
  ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``), the layout AutoAWQ 0.2 writes.
* compressed-tensors: ``compressed-tensors==0.19.0:compressed_tensors/compressors/pack_quantized/base.py``
  (``decompress``: zero points packed with ``packed_dim=0``) and ``quantization/lifecycle/forward.py``
  (``dequantize``: ``(x_q - zero_point) * scale``).
* FP8 block: ``transformers==5.24.0:src/transformers/integrations/finegrained_fp8.py``
  (``_dequantize_fp8_weight``: scale rows repeated ``block[0]`` times then cut to ``out``, columns likewise),
  the DeepSeek-V3 layout (``weight_block_size: [128, 128]``).
* fbgemm FP8: ``transformers==5.24.0:src/transformers/integrations/fbgemm_fp8.py`` (``FbgemmFp8Linear``:
  ``f8f8bf16_rowwise(x_q, weight, x_scale, weight_scale)``, one float32 scale per output row).
"""

from __future__ import annotations

from typing import Optional

import torch

from trtpipe.errors import CheckpointError

NIBBLES = 8  # 4-bit codes per int32 word
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output column c of a word is nibble AWQ_REVERSE_ORDER[c]
GPTQ_V1_ZERO_OFFSET = 0x11111111  # +1 on each nibble of a v1 qzeros word


def unpack_int32(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """int32 words holding 8 unsigned 4-bit codes each (the lowest nibble first) along ``dim`` -> int64 codes
    0..15, ``8x`` longer along ``dim``."""
    w = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    codes = (w.unsqueeze(-1) >> (4 * torch.arange(NIBBLES, dtype=torch.int64))) & 0xF
    return codes.flatten(-2).movedim(-1, dim)


def pack_int4_to_int32(q: torch.Tensor) -> torch.Tensor:
    """int4 codes ``[out, in]`` (int8, -8..7) -> ``[out, ceil(in/8)]`` int32: +8 offset, eight codes per word
    along the input dim, code k of a word at bits 4k (compressed-tensors ``pack_to_int32``, packed_dim=1)."""
    out_f, in_f = q.shape
    u = (q.to(torch.int64) + 8) & 0xF
    pad = -in_f % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    words = (u.reshape(out_f, -1, 8) << (4 * torch.arange(8, dtype=torch.int64))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int32_to_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_to_int32`: ``[out, ceil(in/8)]`` int32 -> ``[out, in]`` int8 codes."""
    return (unpack_int32(packed, 1)[:, :in_features] - 8).to(torch.int8)


def unpack_awq_words(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM int32 words ``[r, c]`` -> int64 codes 0..15 ``[r, 8c]`` in output-column order (the
    interleaved nibble order undone)."""
    codes = unpack_int32(words, 1).unflatten(1, (words.shape[1], NIBBLES))
    return codes[..., torch.tensor(AWQ_REVERSE_ORDER)].flatten(1)


def _need(t: dict, key: str, what: str, fmt: str) -> torch.Tensor:
    if key not in t:
        raise CheckpointError(f"tensor '{what}.{key}' is missing ({fmt})")
    return t[key]


def _shape(t: torch.Tensor, key: str, want: tuple, what: str, fmt: str, dtype: Optional[torch.dtype] = None) -> None:
    if tuple(t.shape) != tuple(want) or (dtype is not None and t.dtype != dtype):
        raise CheckpointError(
            f"tensor '{what}.{key}' is {t.dtype} {list(t.shape)}, {fmt} stores "
            f"{list(want)}" + (f" {dtype}" if dtype is not None else "")
        )


def _groups(in_f: int, n_groups: int, key: str, what: str, fmt: str) -> int:
    """The group size ``in_f / n_groups``, which must divide ``in_f``."""
    if n_groups < 1 or in_f % n_groups:
        raise CheckpointError(
            f"tensor '{what}.{key}' has {n_groups} groups, which do not divide in_features {in_f} ({fmt})"
        )
    return in_f // n_groups


def gptq(t: dict, what: str, v1: bool, group_size: Optional[int] = None) -> torch.Tensor:
    """GPTQ ``qweight`` / ``qzeros`` / ``scales`` (/ ``g_idx``) -> float32 ``[out, in]`` (any zero points, any
    ``g_idx``: act-order groups are gathered, not refused)."""
    fmt = "GPTQ 4-bit"
    qw, qz, s = (_need(t, k, what, fmt) for k in ("qweight", "qzeros", "scales"))
    if qw.dtype != torch.int32 or qw.dim() != 2:
        raise CheckpointError(f"tensor '{what}.qweight' is {qw.dtype} {list(qw.shape)}, {fmt} stores int32 [in/8, out]")
    in_f, out_f = qw.shape[0] * NIBBLES, qw.shape[1]
    if s.dim() != 2 or s.shape[1] != out_f:
        raise CheckpointError(
            f"tensor '{what}.scales' has shape {list(s.shape)}, {fmt} of qweight "
            f"{list(qw.shape)} stores [in/g, {out_f}]"
        )
    g = _groups(in_f, s.shape[0], "scales", what, fmt)
    if group_size is not None and group_size > 0 and g != group_size:
        raise CheckpointError(
            f"tensor '{what}.scales' has shape {list(s.shape)}: group size {g}, the config says {group_size} ({fmt})"
        )
    if out_f % NIBBLES:
        raise CheckpointError(f"tensor '{what}.qzeros': {out_f} output columns do not pack into int32 words ({fmt})")
    _shape(qz, "qzeros", (s.shape[0], out_f // NIBBLES), what, fmt, torch.int32)
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(in_f) // g
    else:
        _shape(g_idx, "g_idx", (in_f,), what, fmt)
        g_idx = g_idx.to(torch.int64)
        if bool((g_idx < 0).any() or (g_idx >= s.shape[0]).any()):
            raise CheckpointError(f"tensor '{what}.g_idx' names groups outside 0..{s.shape[0] - 1} ({fmt})")
    if v1:  # the v1 format stores z - 1 per nibble: read back word-wise, as GPTQModel converts v1 to v2
        qz = (qz.to(torch.int64) + GPTQ_V1_ZERO_OFFSET).to(torch.int64)
    q = unpack_int32(qw, 0).float()  # [in, out]
    z = unpack_int32(qz, 1).float()  # [in/g, out]
    return ((q - z[g_idx]) * s.float()[g_idx]).t().contiguous()


def awq_gemm(t: dict, what: str, group_size: int) -> torch.Tensor:
    """AutoAWQ GEMM ``qweight`` / ``qzeros`` / ``scales`` -> float32 ``[out, in]``."""
    fmt = "AutoAWQ GEMM"
    qw, qz, s = (_need(t, k, what, fmt) for k in ("qweight", "qzeros", "scales"))
    if qw.dtype != torch.int32 or qw.dim() != 2:
        raise CheckpointError(f"tensor '{what}.qweight' is {qw.dtype} {list(qw.shape)}, {fmt} stores int32 [in, out/8]")
    in_f, out_f = qw.shape[0], qw.shape[1] * NIBBLES
    if s.dim() != 2 or s.shape[1] != out_f:
        raise CheckpointError(
            f"tensor '{what}.scales' has shape {list(s.shape)}, {fmt} of qweight "
            f"{list(qw.shape)} stores [in/g, {out_f}]"
        )
    g = _groups(in_f, s.shape[0], "scales", what, fmt)
    if g != group_size:
        raise CheckpointError(
            f"tensor '{what}.scales' has shape {list(s.shape)}: group size {g}, the config says {group_size} ({fmt})"
        )
    _shape(qz, "qzeros", (s.shape[0], out_f // NIBBLES), what, fmt, torch.int32)
    q, z = unpack_awq_words(qw).float(), unpack_awq_words(qz).float().repeat_interleave(g, dim=0)
    return ((q - z) * s.float().repeat_interleave(g, dim=0)).t().contiguous()


def pack_quantized(
    t: dict, what: str, out_f: int, in_f: int, group_size: Optional[int], symmetric: bool
) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` 4-bit ``weight_packed`` / ``weight_scale`` (/ ``weight_zero_point``)
    -> float32 ``[out, in]``; ``group_size`` None: one scale per output row."""
    fmt = "compressed-tensors pack-quantized 4-bit"
    wp, s = _need(t, "weight_packed", what, fmt), _need(t, "weight_scale", what, fmt)
    words = -(-in_f // NIBBLES)
    _shape(wp, "weight_packed", (out_f, words), what, fmt, torch.int32)
    if group_size is None:
        if s.numel() != out_f:
            raise CheckpointError(
                f"tensor '{what}.weight_scale' has shape {list(s.shape)}, {fmt} per channel stores [{out_f}, 1]"
            )
        s, g = s.reshape(out_f, 1), in_f
    else:
        if in_f % group_size:
            raise CheckpointError(
                f"tensor '{what}.weight_packed': group size {group_size} does not divide in_features {in_f} ({fmt})"
            )
        _shape(s, "weight_scale", (out_f, in_f // group_size), what, fmt)
        g = group_size
    q = (unpack_int32(wp, 1)[:, :in_f] - 8).float()
    zp = t.get("weight_zero_point")
    if symmetric:
        if zp is not None and bool(zp.any()):
            raise CheckpointError(f"tensor '{what}.weight_zero_point' is not zero in a symmetric scheme ({fmt})")
        z = torch.zeros(1)
    else:
        if zp is None:
            raise CheckpointError(f"tensor '{what}.weight_zero_point' is missing (asymmetric {fmt})")
        _shape(zp, "weight_zero_point", (-(-out_f // NIBBLES), s.shape[1]), what, fmt, torch.int32)
        z = (unpack_int32(zp, 0)[:out_f] - 8).float().repeat_interleave(g, dim=1)
    return (q - z) * s.float().repeat_interleave(g, dim=1)


def int8_channel(t: dict, what: str, out_f: int, in_f: int) -> torch.Tensor:
    """compressed-tensors ``int-quantized`` INT8 ``weight`` [out, in] x ``weight_scale`` [out, 1] -> float32."""
    fmt = "compressed-tensors INT8"
    w, s = _need(t, "weight", what, fmt), _need(t, "weight_scale", what, fmt)
    _shape(w, "weight", (out_f, in_f), what, fmt, torch.int8)
    if s.numel() != out_f:
        raise CheckpointError(
            f"tensor '{what}.weight_scale' has shape {list(s.shape)}, {fmt} per channel stores [{out_f}, 1]"
        )
    return w.float() * s.float().reshape(out_f, 1)


def fp8_block(t: dict, what: str, block: tuple[int, int], scale_key: str = "weight_scale_inv") -> torch.Tensor:
    """Block-scaled FP8 ``weight`` [out, in] x ``scale_key`` [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]."""
    fmt = f"FP8 block {block[0]}x{block[1]}"
    w, s = _need(t, "weight", what, fmt), _need(t, scale_key, what, fmt)
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise CheckpointError(
            f"tensor '{what}.weight' is {w.dtype} {list(w.shape)}, {fmt} stores float8_e4m3fn [out, in]"
        )
    out_f, in_f = w.shape
    _shape(s, scale_key, (-(-out_f // block[0]), -(-in_f // block[1])), what, fmt)
    full = s.float().repeat_interleave(block[0], dim=0)[:out_f].repeat_interleave(block[1], dim=1)[:, :in_f]
    return w.float() * full


def fp8_rowwise(t: dict, what: str) -> torch.Tensor:
    """fbgemm FP8 ``weight`` [out, in] x ``weight_scale`` [out, 1] -> float32 [out, in]."""
    fmt = "fbgemm FP8 rowwise"
    w, s = _need(t, "weight", what, fmt), _need(t, "weight_scale", what, fmt)
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise CheckpointError(
            f"tensor '{what}.weight' is {w.dtype} {list(w.shape)}, {fmt} stores float8_e4m3fn [out, in]"
        )
    if s.numel() != w.shape[0]:
        raise CheckpointError(f"tensor '{what}.weight_scale' has shape {list(s.shape)}, {fmt} stores [{w.shape[0]}, 1]")
    return w.float() * s.float().reshape(-1, 1)
