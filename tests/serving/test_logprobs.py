"""Logprobs in the executor's sampling step against transformers' float64 log-softmax: the chosen token's and the
top k for every output token, the prompt's for every prompt position, under every scheduling path (in-flight,
chunked context, MAX_UTILIZATION pauses, prefix reuse); ``min_tokens`` keeps the end id out until it is reached.

Tolerance: ``ORDER_FACTOR`` x the float32 error of the reference runtime's own unbatched log-softmax on the same
sequence (tests/numerics.py), never a fixed number."""

from __future__ import annotations

import pytest
import torch

from numerics import ORDER_FACTOR, U32, error_scale
from trtpipe.serving.api import CapacityPolicy, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

from serving_oracle import small_config

EOS = 2


_config = small_config


SCENARIOS = {
    "inflight": dict(),
    "chunked": dict(enable_chunked_context=True, max_num_tokens=16),
    "max-util-tiny-pool": dict(capacity_policy=CapacityPolicy.MAX_UTILIZATION, num_blocks=17),
    "reuse": dict(enable_kv_cache_reuse=True),
}


@torch.no_grad()
def _reference(model, oracle, seq: list[int]):
    """(float64 log-softmax [L, V] of transformers, the float32 error scale of the reference runtime's own)."""
    lp64 = torch.log_softmax(oracle(torch.tensor([seq])).logits[0].double(), -1)
    lp32 = torch.log_softmax(model(torch.tensor([seq]))[0].float(), -1)
    return lp64, error_scale(lp32, lp64, U32)


def _check(got, lp64_row, token: int, k: int, tol: float, what: str) -> None:
    assert got.token == token, what
    assert abs(got.logprob - float(lp64_row[token])) <= tol, (what, got.logprob, float(lp64_row[token]), tol)
    assert len(got.top) == k, what
    kth = float(lp64_row.topk(k).values[-1]) if k else 0.0
    values = [v for _, v in got.top]
    assert values == sorted(values, reverse=True), what
    for tid, v in got.top:  # each a true top-k member (up to float32 ties) with its own logprob
        assert abs(v - float(lp64_row[tid])) <= tol, (what, tid, v, float(lp64_row[tid]))
        assert float(lp64_row[tid]) >= kth - 2 * tol, (what, tid)


@pytest.mark.parametrize("name", SCENARIOS)
def test_logprobs_equal_float64_log_softmax(name, model_tp1, oracle):
    g = torch.Generator().manual_seed(len(name))
    prefix = [1, 403, 407, 261, 378, 261, 300, 1, 365, 1, 300, 403, 407, 261, 378, 261, 300]  # 2 blocks of 8
    prompts = [
        (prefix if name == "reuse" else [1]) + torch.randint(3, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 36, (8,), generator=g)
    ]
    final = {}
    core = ExecutorCore(
        _config(**SCENARIOS[name]),
        ReferenceEngine(model_tp1),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
    )
    asks = []
    for i, p in enumerate(prompts):
        k, pk = i % 4, (i + 1) % 3  # top 0..3 for output tokens, 0..2 for the prompt
        sampling = SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_k=40, seed=i)
        rid = core.submit(
            Request(
                p, 12, end_id=EOS, sampling=sampling, exclude_input_from_output=True, logprobs=k, prompt_logprobs=pk
            )
        )
        asks.append((rid, p, k, pk))
        core.iterate()
    core.run_until_idle()
    if name.startswith("max-util"):
        assert max(s.num_paused for s in core.iterations) > 0, "the tiny pool should have forced pauses"
    if name == "reuse":
        assert core.pool.stats().reused_blocks == 0, "a request scoring its prompt must compute every position"
    for rid, p, k, pk in asks:
        r = final[rid]
        assert not r.has_error, r.error
        lp64, scale = _reference(model_tp1, oracle, p + r.tokens)
        tol = ORDER_FACTOR * scale
        assert len(r.logprobs) == len(r.tokens)
        for j, (tok, got) in enumerate(zip(r.tokens, r.logprobs)):
            _check(got, lp64[len(p) + j - 1], tok, k, tol, f"{name} request {rid} output token {j}")
        assert r.cum_log_prob == pytest.approx(sum(x.logprob for x in r.logprobs), abs=1e-9)
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        for i in range(1, len(p)):
            _check(r.prompt_logprobs[i], lp64[i - 1], p[i], pk, tol, f"{name} request {rid} prompt token {i}")


def test_streamed_logprobs_join_to_the_final_ones(model_tp1):
    got, final = [], {}

    def on(r):
        assert not r.has_error, r.error
        got.append(r)

    core = ExecutorCore(_config(), ReferenceEngine(model_tp1), on)
    core.submit(Request([1, 403, 407, 261], 20, streaming=True, logprobs=2, prompt_logprobs=1))
    core.run_until_idle()
    core2 = ExecutorCore(_config(), ReferenceEngine(model_tp1), lambda r: final.__setitem__(0, r))
    core2.submit(Request([1, 403, 407, 261], 20, exclude_input_from_output=True, logprobs=2, prompt_logprobs=1))
    core2.run_until_idle()
    assert [t for r in got for t in r.tokens] == final[0].tokens
    assert [x for r in got for x in r.logprobs] == final[0].logprobs
    assert [r.prompt_logprobs is not None for r in got] == [True] + [False] * (len(got) - 1)
    assert got[0].prompt_logprobs == final[0].prompt_logprobs


def test_min_tokens_keeps_the_end_id_out_until_reached(model_tp1, oracle):
    prompt = [1, 403, 407, 261]
    free = {}
    core = ExecutorCore(_config(), ReferenceEngine(model_tp1), lambda r: free.__setitem__(0, r))
    core.submit(Request(prompt, 8, exclude_input_from_output=True))
    core.run_until_idle()
    greedy = free[0].tokens
    end = greedy[2]  # an end id the greedy text reaches at its 3rd token
    out = {}
    core = ExecutorCore(_config(), ReferenceEngine(model_tp1), lambda r: out.__setitem__(r.request_id, r))
    short = core.submit(Request(prompt, 8, end_id=end, exclude_input_from_output=True))
    held = core.submit(Request(prompt, 8, end_id=end, exclude_input_from_output=True, min_tokens=6, logprobs=1))
    core.run_until_idle()
    assert out[short].tokens == greedy[:2]
    tokens = out[held].tokens
    assert tokens[:2] == greedy[:2] and len(tokens) >= 6 and end not in tokens[:6]
    with torch.no_grad():
        lp64 = torch.log_softmax(oracle(torch.tensor([prompt + tokens[:2]])).logits[0, -1].double(), -1)
    top2 = lp64.topk(2).indices.tolist()
    assert top2[0] == end and tokens[2] == top2[1]  # the best token but the end id
    # the logprob is the raw distribution's: the banned end id is still the top entry
    assert out[held].logprobs[2].top[0][0] == end


@pytest.mark.parametrize("field,value", [("logprobs", 21), ("prompt_logprobs", -1), ("min_tokens", -2)])
def test_out_of_range_logprob_settings_fail_alone(model_tp1, field, value):
    out = {}
    core = ExecutorCore(_config(), ReferenceEngine(model_tp1), lambda r: out.__setitem__(r.request_id, r))
    bad = core.submit(Request([1, 403], 4, **{field: value}))
    good = core.submit(Request([1, 403], 4, logprobs=0))
    core.run_until_idle()
    assert out[bad].has_error and field in out[bad].error
    assert not out[good].has_error and len(out[good].logprobs) == 4


def test_the_mpi_wire_carries_the_rows_a_step_needs():
    """Worker ranks run the same packed step from the broadcast batch: they must put the same rows (prompt-scoring
    positions included) through the LM head, or the pipeline's last stage sends rank 0 the wrong shape."""
    pytest.importorskip("trtpipe.runtime.distributed")
    from trtpipe.serving.api import StepBatch, StepEntry
    from trtpipe.serving.logprobs import rows_of
    from trtpipe.serving.mpi_engine import unwire, wire

    batch = StepBatch(
        3,
        [
            StepEntry(1, [1, 403, 407, 261], 0, [0], True, False, prompt_logprobs=2, prompt_targets=[403, 407, 261, 9]),
            StepEntry(2, [5, 6, 7], 0, [1], True, True, logprobs=1, prompt_logprobs=0, prompt_targets=[6, 7]),
            StepEntry(3, [8], 12, [2, 3], False, True, logprobs=0),
            # the two-model form's target request: its prompt ends with 2 external drafts (k + 1 = 3 rows)
            StepEntry(4, [1, 9, 10, 11, 12], 0, [4], True, True, context_drafts=2),
        ],
    )
    assert rows_of(unwire(wire(batch))) == rows_of(batch)
    assert rows_of(batch)[0] == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12]
