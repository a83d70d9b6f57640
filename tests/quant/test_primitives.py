"""Quantization primitives against hand-worked values and independent re-implementations."""

from __future__ import annotations

import pytest
import torch

from numerics import U32
from trtpipe.formats.primitives import (
    choose_qparams,
    dequantize,
    fake_quant,
    observe_amax,
    pack_int4_rows,
    quantize,
    unpack_int4_rows,
)


def test_amax_granularities():
    w = torch.tensor([[1.0, -4.0, 2.0, 0.5], [-3.0, 0.25, 0.0, 8.0]])
    assert observe_amax(w, "tensor").tolist() == [8.0]
    assert observe_amax(w, "channel").tolist() == [4.0, 8.0]
    assert observe_amax(w, 2).tolist() == [[4.0, 2.0], [3.0, 8.0]]
    with pytest.raises(ValueError, match="not a multiple of group size 3"):
        observe_amax(w, 3)


def test_int8_channel_by_hand():
    w = torch.tensor([[127.0, -63.4, 0.6], [2.54, -2.54, 1.27]])
    s = choose_qparams(observe_amax(w, "channel"), "int8")
    assert torch.allclose(s, torch.tensor([1.0, 0.02]), rtol=3 * U32, atol=0)  # amax/127 rounded, and 0.02 itself
    q = quantize(w, s, "int8", "channel")
    assert q.dtype == torch.int8 and q.tolist() == [[127, -63, 1], [127, -127, 64]]
    assert ((dequantize(q, s, "int8", "channel") - w).abs() <= s[:, None] / 2 * (1 + 4 * U32)).all()  # half a step


def test_int4_group_clamp_and_zero_amax():
    w = torch.tensor([[7.0, -7.0, 0.0, 0.0], [3.5, 1.0, -2.0, 0.49]])
    s = choose_qparams(observe_amax(w, 2), "int4")
    assert s[0, 1] == 1.0  # zero group -> scale 1, codes 0
    q = quantize(w, s, "int4", 2)
    assert q.tolist() == [[7, -7, 0, 0], [7, 2, -7, 2]]


def test_fp8_saturates_and_roundtrips():
    x = torch.linspace(-500, 500, 101)
    s = torch.tensor([1.0])
    y = fake_quant(x, s, "fp8")
    assert y.abs().max() == 448.0
    inside = x.abs() < 448
    assert ((y[inside] - x[inside]).abs() <= x[inside].abs() * 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits


def test_int4_pack_layout_by_hand():
    q = torch.tensor([[1, -8, 7], [-1, 3, -2]], dtype=torch.int8)  # rows 0 and 1 share bytes
    p = pack_int4_rows(q)
    assert p.dtype == torch.int8 and p.shape == (1, 3)
    assert p.view(torch.uint8).tolist() == [[0xF1, 0x38, 0xE7]]  # low nibble = even row
    assert torch.equal(unpack_int4_rows(p), q)


def test_int4_pack_roundtrip_random():
    q = torch.randint(-8, 8, (64, 40), dtype=torch.int8)
    assert torch.equal(unpack_int4_rows(pack_int4_rows(q)), q)
    with pytest.raises(ValueError, match="odd"):
        pack_int4_rows(q[:3])


def test_nvfp4_quantize_is_the_inverse_of_dequantize():
    """Weights on the NVFP4 grid (each 16-block's largest magnitude 6 x an FP8-exact block scale) survive
    quantize -> dequantize bit for bit: the writer's packing and the readers' unpacking agree on nibble order, code
    signs and scales."""
    from trtpipe.formats.primitives import E2M1_VALUES, nvfp4_dequantize, nvfp4_quantize

    g = torch.Generator().manual_seed(0)
    values = E2M1_VALUES[torch.randint(0, 8, (8, 64), generator=g)] * torch.where(
        torch.rand(8, 64, generator=g) < 0.5, -1.0, 1.0
    )
    values[:, ::16] = 6.0  # every block reaches the top code, so its scale is recovered exactly
    scales = 2.0 ** torch.randint(-4, 3, (8, 4), generator=g).float()
    w = values * scales.repeat_interleave(16, dim=1)
    wsf2 = torch.tensor(1.0)
    packed, bs = nvfp4_quantize(w, wsf2)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (8, 32) and torch.equal(bs.float(), scales)
    assert torch.equal(nvfp4_dequantize(packed, bs, wsf2), w)
    assert torch.equal(packed[0, 0] & 0xF, torch.tensor(7, dtype=torch.uint8))  # 6.0, even column in the low nibble
