"""The engine import streams: FP8 requantization of fused members runs a block of rows at a time and gives the
same codes as requantizing the whole weight; a linear of one FP8 member is the source's own view (the writer
streams it from the file and drops its pages), not a copy. Peak RSS itself: scripts/bench_import.py."""

from __future__ import annotations

import torch

from trtpipe.formats.primitives import dequantize, quantize
from trtpipe.quant.imported import trtllm


def test_blockwise_requantization_equals_the_whole_weights(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(37, 64, generator=g) * 100).to(torch.float8_e4m3fn)
    s_from, s_to = torch.tensor([0.011]), torch.tensor([0.013])
    whole = quantize(dequantize(q, s_from, "fp8", "tensor"), s_to, "fp8", "tensor")
    monkeypatch.setattr(trtllm, "REQUANT_BYTES", 5 * 64 * 4)  # 5 rows a block: 8 blocks, the last one short
    blocks = trtllm.requantize_fp8(q, s_from, s_to)
    assert torch.equal(blocks.view(torch.uint8), whole.view(torch.uint8))
    assert not torch.equal(blocks.view(torch.uint8), q.view(torch.uint8))  # the scales differ: codes really change


def test_one_fp8_member_is_not_copied():
    w = (torch.randn(8, 16) * 50).to(torch.float8_e4m3fn)
    fused = trtllm.FUSE["FP8"](
        [{"weight": w, "weight_scale": torch.tensor(0.01), "input_scale": torch.tensor(0.1)}],
        16,
        torch.bfloat16,
        "test",
    )
    assert fused["weight"] is w
