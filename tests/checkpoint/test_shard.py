"""The split functions: shards concatenate back to the original, and the GQA/MoE/vocab/PP rules of the contract."""

from __future__ import annotations

import pytest
import torch

from trtpipe.checkpoint.shard import (
    Layout,
    pad_dim,
    pp_layers,
    replicate_kv_heads,
    split_experts,
    split_linear_tensor,
    split_sections,
    split_vocab,
)
from trtpipe.errors import CheckpointError


def _lay(**kw):
    base = dict(num_heads=8, num_kv_heads=2, head_size=4)
    return Layout(**{**base, **kw})


@pytest.mark.parametrize("style,dim", [("column", 0), ("row", 1)])
def test_column_and_row_shards_concatenate_back(style, dim):
    w = torch.randn(12, 8)
    shards = [split_linear_tensor(w, "weight", style, r, _lay(tp=4)) for r in range(4)]
    assert torch.equal(torch.cat(shards, dim=dim), w)


def test_bias_and_scales_follow_the_weight_plan():
    lay = _lay(tp=2)
    bias, per_channel, per_tensor, prequant = torch.randn(6), torch.randn(6), torch.tensor([0.5]), torch.randn(8)
    group = torch.randn(6, 4)  # [out, in/g]
    assert torch.equal(split_linear_tensor(bias, "bias", "column", 1, lay), bias[3:])
    assert torch.equal(split_linear_tensor(bias, "bias", "row", 1, lay), bias)  # added once after the all-reduce
    assert torch.equal(split_linear_tensor(per_channel, "per_channel_scale", "column", 1, lay), per_channel[3:])
    assert torch.equal(split_linear_tensor(per_channel, "weights_scaling_factor", "row", 1, lay), per_channel)
    assert torch.equal(split_linear_tensor(per_tensor, "weights_scaling_factor", "column", 1, lay), per_tensor)
    assert torch.equal(split_linear_tensor(prequant, "prequant_scaling_factor", "row", 1, lay), prequant[4:])
    assert torch.equal(split_linear_tensor(prequant, "prequant_scaling_factor", "column", 1, lay), prequant)
    assert torch.equal(split_linear_tensor(group, "weights_scaling_factor", "row", 1, lay), group[:, 2:])
    assert torch.equal(split_linear_tensor(group, "weights_scaling_factor", "column", 1, lay), group[3:])


def test_qkv_gqa_split_gives_each_rank_its_heads():
    d, nh, nkv, h = 4, 8, 4, 16
    q, k, v = torch.randn(nh * d, h), torch.randn(nkv * d, h), torch.randn(nkv * d, h)
    fused = torch.cat([q, k, v])
    lay = Layout(nh, nkv, d, tp=2)
    r1 = split_linear_tensor(fused, "weight", "qkv", 1, lay)
    assert torch.equal(r1, torch.cat([q[16:], k[8:], v[8:]]))


def test_qkv_mha_split_matches_the_view_3_rule():
    d, nh, h = 4, 4, 16
    fused = torch.randn(3 * nh * d, h)
    lay = Layout(nh, nh, d, tp=2)
    expected = fused.view(3, nh * d, h)[:, nh * d // 2 :].reshape(-1, h)  # [3, H, H] split on the middle dim
    assert torch.equal(split_linear_tensor(fused, "weight", "qkv", 1, lay), expected)


def test_kv_heads_replicated_when_fewer_than_tp():
    d, nh, nkv, h, tp = 2, 8, 2, 4, 4
    q = torch.randn(nh * d, h)
    k = torch.arange(nkv * d * h, dtype=torch.float32).view(nkv * d, h)
    v = -k
    fused = torch.cat([q, k, v])
    rep = replicate_kv_heads(fused, 0, nh * d, nkv, d, tp)
    assert rep.shape[0] == nh * d + 2 * tp * d
    lay = Layout(nh, nkv, d, tp=tp)
    for r in range(tp):
        shard = split_linear_tensor(fused, "weight", "qkv", r, lay)
        head = r // (tp // nkv)
        assert torch.equal(shard[2 * d : 3 * d], k[head * d : (head + 1) * d])
        assert torch.equal(shard[3 * d :], v[head * d : (head + 1) * d])
        assert torch.equal(shard[: 2 * d], q[r * 2 * d : (r + 1) * 2 * d])


def test_kv_replication_needs_tp_multiple_of_kv_heads():
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        Layout(12, 3, 4, tp=4).check()
    with pytest.raises(CheckpointError, match="num_attention_heads=8 is not divisible by tp=3"):
        Layout(8, 8, 4, tp=3).check()


def test_vocab_padding_is_zero_rows_then_split():
    w = torch.randn(10, 3)
    shards = [split_vocab(w, r, 4) for r in range(4)]
    assert all(s.shape == (3, 3) for s in shards)
    full = torch.cat(shards)
    assert torch.equal(full[:10], w) and torch.equal(full[10:], torch.zeros(2, 3))
    assert pad_dim(w, 0, 5) is w


@pytest.mark.parametrize(
    "layers,pp,expected",
    [
        (5, 2, [range(0, 3), range(3, 5)]),
        (4, 2, [range(0, 2), range(2, 4)]),
        (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),
    ],
)
def test_pp_layers_follow_tensor_split(layers, pp, expected):
    assert [pp_layers(layers, pp, p) for p in range(pp)] == expected
    ref = [list(c) for c in torch.tensor_split(torch.arange(layers), pp)]
    assert [list(r) for r in expected] == [[int(i) for i in c] for c in ref]


def test_moe_expert_parallel_blocks_and_tp_halves():
    E, I, H = 4, 6, 5
    w3, w1 = torch.randn(E, I, H), torch.randn(E, I, H)
    fc = torch.cat([w3, w1], dim=-2)  # [E, 2I, H]
    ep = Layout(8, 8, 4, tp=2, num_experts=E, moe_tp=1, moe_ep=2)
    assert torch.equal(split_experts(fc, 1, ep), fc[2:])
    tp = Layout(8, 8, 4, tp=2, num_experts=E, moe_tp=2, moe_ep=1)
    r1 = split_linear_tensor(split_experts(fc, 1, tp), "weight", "column", 1, tp, sections=(I, I), experts=E)
    assert torch.equal(r1, torch.cat([w3[:, 3:], w1[:, 3:]], dim=-2))
    scale = torch.rand(E, 1)  # per-expert per-tensor scale: replicated over moe_tp
    assert torch.equal(split_linear_tensor(scale, "weights_scaling_factor", "column", 1, tp, experts=E), scale)


def test_sections_must_add_up():
    with pytest.raises(CheckpointError, match="expected 10"):
        split_sections(torch.zeros(12, 2), 0, [4, 6], 0, 2, "x")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_non_finite_detection_exact(dtype):
    from trtpipe.checkpoint.hf import has_non_finite

    big = torch.full((64, 64), torch.finfo(dtype).max, dtype=dtype)  # finite, but its sum overflows
    assert not has_non_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(64, 64).to(dtype)
        t[17, 3] = bad
        assert has_non_finite(t) and has_non_finite(t[:, :8])  # also through a strided view
    assert not has_non_finite(torch.randn(64, 64).to(dtype)[:, 8:])
