"""The executor's paged path on Gemma 3 (sliding-window layers with their own rope, one global layer): every
request's greedy tokens are transformers' (float64) with prompts and continuations longer than the window, under
in-flight batching, chunked context and KV-block reuse, at tp1 and tp2."""

from __future__ import annotations

import pytest
import torch

from numerics import hf_float64
from serving_oracle import check_greedy
from trtpipe.checkpoint.convert import convert
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import load_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("g3srv")
    d = make_synthetic("gemma3", root / "hf", seed=2)
    models = {tp: load_checkpoint(convert(d, root / f"tp{tp}", tp=tp, dtype="float32")) for tp in (1, 2)}
    hf = load_hf(d)
    return models, hf_float64(hf), hf


def _workload(n: int, seed: int, shared_prefix=()):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        list(shared_prefix) + torch.randint(3, 250, (int(k),), generator=g).tolist()
        for k in torch.randint(6, 30, (n,), generator=g)
    ]  # every prompt longer than the window (5)
    lengths = [int(k) for k in torch.randint(8, 24, (n,), generator=g)]
    return prompts, lengths


def _serve(model, config, prompts, lengths):
    final = {}
    core = ExecutorCore(
        config, ReferenceEngine(model), lambda r: final.__setitem__(r.request_id, r) if r.is_final else None
    )
    ids = []
    for p, n in zip(prompts, lengths):
        ids.append(core.submit(Request(p, n, exclude_input_from_output=True)))
        core.iterate()
    core.run_until_idle()
    return [final[i] for i in ids], core


SCENARIOS = {
    "inflight": dict(),
    "chunked": dict(enable_chunked_context=True, max_num_tokens=16),
    "reuse": dict(enable_kv_cache_reuse=True),
}


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("name", SCENARIOS)
def test_gemma3_greedy_tokens_equal_transformers_past_the_window(name, tp, gemma3):
    models, hf64, _ = gemma3
    assert models[tp].args.window(0) == 5 and models[tp].args.window(5) is None
    prefix = list(range(10, 27)) if name == "reuse" else ()  # 17 shared tokens: 2 blocks of 8
    prompts, lengths = _workload(6, seed=len(name) + tp, shared_prefix=prefix)
    config = ExecutorConfig(
        **{
            **dict(
                max_batch_size=8,
                max_num_tokens=64,
                max_input_len=96,
                max_seq_len=128,
                num_blocks=64,
                tokens_per_block=8,
            ),
            **SCENARIOS[name],
        }
    )
    out, core = _serve(models[tp], config, prompts, lengths)
    for p, n, r in zip(prompts, lengths, out):
        assert not r.has_error, r.error
        assert len(r.tokens) == n
        assert check_greedy(models[tp], hf64, p, r.tokens, n) == ""
    if name == "reuse":
        assert core.pool.stats().reused_blocks > 0


@pytest.mark.parametrize("tp", (1, 2))
def test_gemma3_paged_step_logits_as_accurate_as_transformers(tp, gemma3):
    """Logits of packed steps (three contexts longer than the window, then their generation tokens batched) against
    transformers float64, as close as transformers' own float32: greedy tokens alone can hide a wrong rope on
    the sliding layers, logits cannot."""
    from numerics import assert_as_accurate, error_scale
    from trtpipe.serving.api import StepBatch, StepEntry

    models, hf64, hf32 = gemma3
    engine = ReferenceEngine(models[tp])
    engine.allocate(num_blocks=16, tokens_per_block=8)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 14, 20)]
    tables = [[4 * i + b for b in range(4)] for i in range(3)]
    ctx = StepBatch(0, [StepEntry(i, p, 0, tables[i], True, True) for i, p in enumerate(prompts)])
    got_ctx = engine.logits(ctx)
    with torch.no_grad():
        ref_ctx = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in prompts])
    nxt = [int(t) for t in ref_ctx.argmax(-1)]
    gen = StepBatch(1, [StepEntry(i, [nxt[i]], len(p), tables[i], False, True) for i, p in enumerate(prompts)])
    got_gen = engine.logits(gen)
    with torch.no_grad():
        ref_gen = torch.stack([hf64(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, nxt)])
        own = torch.stack(
            [hf32(torch.tensor([p])).logits[0, -1] for p in prompts]  # transformers' float32
            + [hf32(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(prompts, nxt)]
        )
    ref = torch.cat([ref_ctx, ref_gen])
    assert_as_accurate(torch.cat([got_ctx, got_gen]), ref, error_scale(own, ref), f"gemma3 paged steps tp{tp}")
