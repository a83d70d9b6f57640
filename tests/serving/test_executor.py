"""The executor end to end on the reference runtime: exact greedy tokens under every scheduling path, and the
spec's behaviour for queue limits, cancellation, pool exhaustion, priorities and perf metrics."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from trtpipe.serving.api import CapacityPolicy, FinishReason, Request, SamplingParams
from trtpipe.serving.executor import Executor, ExecutorCore, QueueFullError, SimClock
from trtpipe.serving.reference_engine import ReferenceEngine

from sampling_odds import sequence_probability
from serving_oracle import check_greedy, small_config

EOS = 2


_config = small_config


def _workload(n: int, seed: int, shared_prefix: list[int] = ()):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        list(shared_prefix) + torch.randint(3, 500, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 40, (n,), generator=g)
    ]
    lengths = [int(k) for k in torch.randint(4, 30, (n,), generator=g)]
    return prompts, lengths


def _serve(model, config, prompts, lengths, stagger=1, end_id=None):
    """Submit request k after k*stagger loop turns; returns (final responses by request, the core)."""
    final = {}
    core = ExecutorCore(
        config, ReferenceEngine(model), lambda r: final.__setitem__(r.request_id, r) if r.is_final else None
    )
    ids = []
    for p, n in zip(prompts, lengths):
        ids.append(core.submit(Request(p, n, end_id=end_id, exclude_input_from_output=True)))
        for _ in range(stagger):
            core.iterate()
    core.run_until_idle()
    return [final[i] for i in ids], core


SCENARIOS = {
    "inflight": dict(),
    "chunked": dict(enable_chunked_context=True, max_num_tokens=16),
    "max-util-tiny-pool": dict(capacity_policy=CapacityPolicy.MAX_UTILIZATION, num_blocks=17, max_seq_len=128),
    "reuse": dict(enable_kv_cache_reuse=True),
    "no-evict-tiny-pool-reuse-chunked": dict(
        num_blocks=20, enable_kv_cache_reuse=True, enable_chunked_context=True, max_num_tokens=24
    ),
    "static": dict(capacity_policy=CapacityPolicy.STATIC_BATCH),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_greedy_tokens_equal_transformers_alone(name, model_tp1, oracle):
    prefix = [1, 403, 407, 261, 378, 261, 300, 1, 365, 1, 300, 403, 407, 261, 378, 261, 300]  # 17 tokens: 2 blocks
    prompts, lengths = _workload(10, seed=len(name), shared_prefix=prefix if "reuse" in name else ())
    out, core = _serve(model_tp1, _config(**SCENARIOS[name]), prompts, lengths, end_id=EOS)
    for p, n, r in zip(prompts, lengths, out):
        assert not r.has_error, r.error
        assert check_greedy(model_tp1, oracle, p, r.tokens, n, EOS) == ""
    stats = core.pool.stats()
    assert stats.free_blocks == stats.max_blocks  # every block came back
    if name.startswith("max-util"):
        assert max(s.num_paused for s in core.iterations) > 0, "the tiny pool should have forced pauses"
    if "reuse" in name:
        assert stats.reused_blocks > 0


def test_tensor_parallel_executor_matches(model_tp2, oracle):
    prompts, lengths = _workload(6, seed=7)
    out, _ = _serve(model_tp2, _config(enable_chunked_context=True, max_num_tokens=24), prompts, lengths)
    for p, n, r in zip(prompts, lengths, out):
        assert check_greedy(model_tp2, oracle, p, r.tokens, n) == ""


def test_new_requests_join_the_running_batch(model_tp1):
    prompts, lengths = _workload(4, seed=3)
    lengths = [20] * 4
    _, core = _serve(model_tp1, _config(), prompts, lengths, stagger=2)
    mixed = [s for s in core.iterations if s.num_context_requests and s.num_generation_requests]
    assert mixed, "a request arriving mid-generation must share a step with the running ones"
    assert max(s.num_generation_requests for s in core.iterations) == 4


def test_queue_limit_refuses_at_once(model_tp1):
    core = ExecutorCore(_config(max_queue_size=2), ReferenceEngine(model_tp1), lambda r: None)
    core.submit(Request([1, 5], 4))
    core.submit(Request([1, 6], 4))
    with pytest.raises(QueueFullError, match="Maximum queue size of 2 has been reached, please try again later"):
        core.submit(Request([1, 7], 4))


def test_prompt_above_max_input_len_is_an_error_response_and_output_is_shortened(model_tp1):
    got = {}
    core = ExecutorCore(
        _config(max_input_len=16, max_seq_len=24),
        ReferenceEngine(model_tp1),
        lambda r: got.__setitem__(r.request_id, r),
    )
    bad = core.submit(Request(list(range(3, 20)), 4))
    long = core.submit(Request([1, 403, 407], 100, exclude_input_from_output=True))
    core.run_until_idle()
    assert got[bad].has_error and "Prompt length (17) exceeds maximum input length (16)" in got[bad].error
    assert len(got[long].tokens) == 24 - 3 and got[long].finish_reason == FinishReason.LENGTH


def test_cancelled_requests_free_their_blocks_within_a_step(model_tp1):
    responses = []
    core = ExecutorCore(_config(), ReferenceEngine(model_tp1), responses.append)
    ids = [core.submit(Request([1, 403, 407, 261], 60, streaming=True)) for _ in range(6)]
    for _ in range(5):
        core.iterate()
    assert core.pool.num_free < core.pool.num_blocks
    for i in ids:
        core.cancel(i)
    core.iterate()  # cancellations apply at the next boundary, before anything else
    assert core.pool.num_free == core.pool.num_blocks
    finals = [r for r in responses if r.is_final]
    assert sorted(r.request_id for r in finals) == ids
    assert all(r.finish_reason == FinishReason.CANCELLED for r in finals)


@pytest.mark.slow
def test_no_evict_queues_and_max_utilization_pauses_when_the_pool_is_short(model_tp1):
    prompts = [[1] + list(range(10, 10 + 30))] * 6
    for policy in (CapacityPolicy.GUARANTEED_NO_EVICT, CapacityPolicy.MAX_UTILIZATION):
        out, core = _serve(
            model_tp1,
            _config(capacity_policy=policy, num_blocks=16, max_seq_len=96, max_num_tokens=128),
            prompts,
            [60] * 6,
            stagger=0,
        )
        assert all(not r.has_error and len(r.tokens) == 60 for r in out)
        paused = max(s.num_paused for s in core.iterations)
        if policy is CapacityPolicy.GUARANTEED_NO_EVICT:
            assert paused == 0 and max(s.num_active - s.num_scheduled for s in core.iterations) > 0
        else:
            assert paused > 0


def test_higher_priority_runs_first(model_tp1):
    order = []
    core = ExecutorCore(
        _config(max_batch_size=1),
        ReferenceEngine(model_tp1),
        lambda r: order.append(r.request_id) if r.is_final else None,
    )
    low = core.submit(Request([1, 5], 3, priority=0.2))
    mid = core.submit(Request([1, 6], 3))
    high = core.submit(Request([1, 7], 3, priority=0.9))
    core.run_until_idle()
    assert order == [high, mid, low]


def test_perf_metrics_are_ordered_and_count_reused_blocks(model_tp1):
    got = {}
    clock = SimClock()
    core = ExecutorCore(
        _config(enable_kv_cache_reuse=True),
        ReferenceEngine(model_tp1),
        lambda r: got.__setitem__(r.request_id, r),
        clock=clock,
    )
    prompt = [1] + list(range(40, 60))  # 21 tokens: 2 full blocks reusable
    a = core.submit(Request(prompt, 5, return_perf_metrics=True))
    core.run_until_idle()
    b = core.submit(Request(prompt, 5, return_perf_metrics=True))
    core.run_until_idle()
    pa, pb = got[a].perf, got[b].perf
    for p in (pa, pb):
        assert p.enqueue_ns <= p.arrival_ns <= p.first_scheduled_ns < p.first_token_ns <= p.last_token_ns
    assert pa.kv_reused_blocks == 0 and pb.kv_reused_blocks == 2
    assert got[a].tokens == got[b].tokens


def test_seeded_sampling_is_repeatable_across_batches(model_tp1):
    def run(n_other, seed=11):
        got = {}
        core = ExecutorCore(_config(), ReferenceEngine(model_tp1), lambda r: got.__setitem__(r.request_id, r))
        rid = core.submit(Request([1, 403, 407], 24, sampling=SamplingParams(1.5, 0, 0.95, seed=seed)))
        for k in range(n_other):
            core.submit(Request([1, 300 + k], 12))
        core.run_until_idle()
        return got[rid].tokens

    first = run(0)
    assert run(5) == first
    # ... and the seed is what decides: another seed draws these same 24 tokens with probability p(first), computed
    # here (7e-12 for this model; asserted below 1e-6), so a seed ignored (a fixed generator) fails this
    assert first[:3] == [1, 403, 407]  # the output starts with the prompt
    assert sequence_probability(model_tp1, [1, 403, 407], first[3:], 1.5, 0, 0.95) < 1e-6
    assert run(0, seed=12) != first


def test_threaded_executor_streams_to_many_callers(model_tp1):
    ex = Executor(_config(), ReferenceEngine(model_tp1))
    try:
        done, streams = threading.Event(), {}
        lock = threading.Lock()

        def collect(r):
            with lock:
                streams.setdefault(r.request_id, []).append(r)
                if sum(1 for v in streams.values() if v[-1].is_final) == 8:
                    done.set()

        ids = [ex.submit(Request([1, 403 + k], 10, streaming=True), collect) for k in range(8)]
        assert done.wait(60)
        for i in ids:
            tokens = [t for r in streams[i] for t in r.tokens]
            assert len(tokens) == 10 and streams[i][-1].finish_reason == FinishReason.LENGTH
    finally:
        ex.shutdown()


@pytest.mark.slow
def test_pauses_credit_only_blocks_the_victim_owns_alone(model_tp1):
    """Identical requests reuse each other's published blocks; pausing one frees only the blocks no running
    request shares, so max_utilization must not count shared ones as freed (that overran the pool on a server)."""
    config = _config(
        capacity_policy=CapacityPolicy.MAX_UTILIZATION,
        enable_kv_cache_reuse=True,
        num_blocks=12,
        max_seq_len=96,
        max_num_tokens=128,
    )
    out, core = _serve(model_tp1, config, [[1, 403, 407, 261, 378]] * 20, [80] * 20, stagger=0)
    assert all(not r.has_error for r in out), [r.error for r in out if r.has_error][:1]
    assert len({tuple(r.tokens) for r in out}) == 1 and len(out[0].tokens) == 80
    assert max(s.num_paused for s in core.iterations) > 0 and core.pool.stats().reused_blocks > 0
    assert core.pool.num_free == core.pool.num_blocks


class _FailingEngine(ReferenceEngine):
    def step(self, batch):
        if batch.iteration == 3:
            raise RuntimeError("device lost")
        return super().step(batch)


def test_a_failed_step_fails_the_active_requests_and_the_executor_goes_on(model_tp1):
    got = {}
    core = ExecutorCore(
        _config(), _FailingEngine(model_tp1), lambda r: got.__setitem__(r.request_id, r) if r.is_final else None
    )
    first = [core.submit(Request([1, 403, 407], 10)) for _ in range(3)]
    core.run_until_idle()
    assert all(
        "Encountered an error in forwardAsync function: RuntimeError: device lost" in got[i].error for i in first
    )
    assert core.pool.num_free == core.pool.num_blocks
    later = core.submit(Request([1, 403, 407], 10, exclude_input_from_output=True))
    core.run_until_idle()
    assert not got[later].has_error and len(got[later].tokens) == 10


def test_iteration_log_writes_each_step_once_with_what_it_computed(model_tp1, tmp_path):
    """``TRTPIPE_ITER_STATS``: one JSON line per step (TensorRT-LLM's IterationStats names), none twice."""
    import json

    from trtpipe.serving.triton_adapter import IterationLog

    prompts, _ = _workload(3, seed=5)
    log = IterationLog(str(tmp_path / "iters.jsonl"))
    _, core = _serve(model_tp1, _config(), prompts, [6, 3, 5], stagger=2)
    assert log.write_new(core.iterations) == len(core.iterations) > 0
    assert log.write_new(core.iterations) == 0
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "iters.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in lines] == [s.iteration for s in core.iterations]
    first = lines[0]["inflightBatchingStats"]
    assert first["numContextRequests"] == 1 and first["numCtxTokens"] == len(prompts[0])
    assert lines[0]["numAttendedTokens"] == len(prompts[0])  # a lone context attends to its own prompt
    assert lines[0]["scheduledEntries"] == [[0, len(prompts[0]), 1]]
    for r in lines:  # each entry: [start, tokens, is context]; the counts agree with them
        b, entries = r["inflightBatchingStats"], r["scheduledEntries"]
        assert sum(ctx for _, _, ctx in entries) == b["numContextRequests"]
        assert sum(n for _, n, ctx in entries if ctx) == b["numCtxTokens"]
        assert sum(start + n for start, n, _ in entries) == r["numAttendedTokens"]
        assert all(n == 1 for _, n, ctx in entries if not ctx)
    # a generation row attends to everything before it, plus the token it writes
    solo = [s for s in core.iterations if s.num_generation_requests == 1 and not s.num_context_requests]
    assert solo and all(s.num_attended_tokens > len(min(prompts, key=len)) for s in solo)


@pytest.mark.parametrize(
    "sampling, message",
    [
        (SamplingParams(temperature=1.0, seed=1 << 64), r"seed must be in \[0, 2\^64\), got 18446744073709551616"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (SamplingParams(temperature=1.0, top_p=2.0), r"top_p must be in \[0, 1\]"),
    ],
)
def test_a_request_with_bad_sampling_fails_alone_and_the_loop_goes_on(model_tp1, sampling, message):
    # The seed case is the one that killed the executor thread: torch.Generator.manual_seed raised OverflowError in
    # admission, outside the step's guard, and every later request waited forever.
    got = {}
    core = ExecutorCore(
        _config(), ReferenceEngine(model_tp1), lambda r: got.__setitem__(r.request_id, r) if r.is_final else None
    )
    bad = core.submit(Request([1, 403, 407], 10, sampling=sampling))
    good = core.submit(Request([1, 403, 407], 10, exclude_input_from_output=True))
    core.run_until_idle()
    assert got[bad].has_error and re.search(message, got[bad].error), got[bad].error
    assert not got[good].has_error and len(got[good].tokens) == 10


def test_an_exception_while_admitting_fails_only_that_request(model_tp1, monkeypatch):
    got = {}
    core = ExecutorCore(
        _config(), ReferenceEngine(model_tp1), lambda r: got.__setitem__(r.request_id, r) if r.is_final else None
    )
    real = core._activate
    first = core.submit(Request([1, 403, 407], 10))
    monkeypatch.setattr(
        core, "_activate", lambda q: (_ for _ in ()).throw(OverflowError("boom")) if q.id == first else real(q)
    )
    later = core.submit(Request([1, 403, 407], 10, exclude_input_from_output=True))
    core.run_until_idle()
    assert "Encountered an error when fetching new request: OverflowError: boom" in got[first].error
    assert not got[later].has_error and len(got[later].tokens) == 10
