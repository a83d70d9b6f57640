"""LoRA on the one-process reference model at tp 2 and 4 (every rank's shards in one process): each adapter
sharded as TensorRT-LLM shards LoRA weights gives the tp 1 logits within the float32 error of the function (peft's
own float32 evaluation against float64), and peft float64's too. tp 4 on stories260k (4 KV heads, 172 MLP units)
splits every linear; the tp 2 one-process-per-rank run is tests/serving/mpi/test_rank_lora.py."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import ADAPTERS, peft_model
from numerics import assert_as_accurate, error_scale
from trtpipe.runtime.lora import attach, load_adapter, shard_pair, whole_batch

PROMPT = [1, 403, 407, 261, 378, 299, 343, 300, 400, 31, 262, 319]


@pytest.fixture(scope="module")
def models(tmp_path_factory, stories_dir):
    """tp -> (one-process model of a float32 checkpoint at that tp, its LoRA context)."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.runtime import load_checkpoint

    root = tmp_path_factory.mktemp("lora_tp")
    out = {}
    for tp in (1, 2, 4):
        m = load_checkpoint(convert(stories_dir, root / f"tp{tp}", tp=tp, dtype="float32"))
        out[tp] = (m, attach(m))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_sharded_adapter_logits_equal_tp1(name, models, adapters, layout, stories_dir):
    adapter = load_adapter(name, adapters[name], layout)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref64 = peft_model(stories_dir, adapters[name], torch.float64)(ids).logits[0]
        ref32 = peft_model(stories_dir, adapters[name], torch.float32)(ids).logits[0]
    scale = error_scale(ref32, ref64)
    got = {}
    for tp, (m, ctx) in models.items():
        with ctx.use(whole_batch(adapter)):
            got[tp] = m(ids)[0]
        assert_as_accurate(got[tp], ref64, scale, f"{name} tp {tp} vs peft float64")
    for tp in (2, 4):
        assert_as_accurate(got[tp], got[1].double(), scale, f"{name} tp {tp} vs tp 1")


def test_shards_are_upstreams_splits(adapters, layout):
    """Row-parallel pairs split lora_A's columns (B whole), column-parallel ones lora_B's rows (A whole); the
    rank shards put back together are the whole pair."""
    adapter = load_adapter("r64-all", adapters["r64-all"], layout)
    for (layer, linear), pair in adapter.pairs.items():
        shards = [shard_pair(pair, linear, r, 2, layout) for r in range(2)]
        if linear in ("attention.dense", "mlp.proj"):
            assert all(torch.equal(s.b, pair.b) for s in shards)
            assert torch.equal(torch.cat([s.a for s in shards], dim=1), pair.a)
        else:
            assert all(torch.equal(s.a, pair.a) for s in shards)
            assert sorted(map(tuple, torch.cat([s.b for s in shards]).tolist())) == sorted(map(tuple, pair.b.tolist()))
            if linear == "attention.qkv":  # [q; k; v] rows: each rank takes its heads of each section
                q = layout.heads[0] * layout.heads[2]
                kv = layout.heads[1] * layout.heads[2]
                for r, s in enumerate(shards):
                    assert torch.equal(s.b[: q // 2], pair.b[r * q // 2 : (r + 1) * q // 2])
                    assert torch.equal(s.b[q // 2 : q // 2 + kv // 2], pair.b[q + r * kv // 2 : q + (r + 1) * kv // 2])
