"""The simulator is the serving executor in simulated time: schedules small enough to work out by hand."""

from __future__ import annotations


import pytest

from trtpipe.formats.gpus import get_gpu
from trtpipe.perf.cost import Constants, Deployment, group_terms, step_time
from trtpipe.perf.models import published_spec
from trtpipe.perf.simulate import CostModelEngine, closed_loop, max_load, poisson
from trtpipe.serving.config import executor_config
from trtpipe.serving.api import StepBatch, StepEntry

STEP = 0.010  # every step costs 10 ms: latencies are multiples of it


def fixed_engine() -> CostModelEngine:
    return CostModelEngine(step_cost=lambda batch: (STEP, "fixed"))


def cfg(max_batch=2, max_tokens=256, seq=256):
    return executor_config(
        max_batch_size=max_batch,
        max_num_tokens=max_tokens,
        max_input_len=seq,
        max_seq_len=seq,
        kv_tokens=4096,
        tokens_per_block=64,
        enable_chunked_context=True,
        enable_kv_cache_reuse=False,
    )


def test_max_load_two_requests_share_every_step():
    r = max_load(cfg(), fixed_engine(), n=2, isl=4, osl=3)
    # step 1: both contexts (first tokens at 10 ms), steps 2 and 3: both generate
    assert r.steps == 3
    assert list(r.ttft) == pytest.approx([STEP, STEP])
    assert list(r.itl) == pytest.approx([STEP, STEP])
    assert r.output_tokens == 6 and r.makespan_s == pytest.approx(3 * STEP)
    assert r.throughput == pytest.approx(6 / (3 * STEP))
    assert r.mean_batch == 2


def test_one_batch_slot_serializes_requests():
    r = max_load(cfg(max_batch=1), fixed_engine(), n=2, isl=4, osl=3)
    assert r.steps == 6
    assert sorted(r.ttft) == pytest.approx([STEP, 4 * STEP])  # the second waits for the first to finish
    assert sorted(r.e2e) == pytest.approx([3 * STEP, 6 * STEP])
    assert r.slots_full > 0.5 and r.load_bound == "batch slots"


def test_chunked_context_takes_one_step_per_token_budget():
    r = max_load(cfg(max_batch=1, max_tokens=64), fixed_engine(), n=1, isl=128, osl=2)
    assert list(r.ttft) == pytest.approx([2 * STEP])  # 128 prompt tokens in chunks of 64
    assert r.steps == 3


def test_closed_loop_sends_the_next_request_when_one_finishes():
    r = closed_loop(cfg(), fixed_engine(), concurrency=1, n=3, isl=4, osl=2)
    assert r.steps == 6
    assert list(r.ttft) == pytest.approx([STEP] * 3)
    assert r.makespan_s == pytest.approx(6 * STEP)
    assert r.throughput == pytest.approx(6 / (6 * STEP))


def test_closed_loop_next_request_arrives_when_the_final_response_is_sent():
    # one slot, two clients: A runs 0-20 ms; B is admitted at 20 (first token 30, done 40); C is sent when A's
    # final response goes out (20 ms) and waits for B: first token at 50 -> TTFT 30 ms
    r = closed_loop(cfg(max_batch=1), fixed_engine(), concurrency=2, n=3, isl=4, osl=2)
    assert sorted(r.ttft) == pytest.approx([STEP, 3 * STEP, 3 * STEP])
    assert r.makespan_s == pytest.approx(6 * STEP)


def test_closed_loop_client_gap_delays_the_next_arrival_not_the_first_token():
    # one client, 5 ms outside the executor between a final response and the next request's arrival:
    # each request still takes 20 ms inside (TTFT 10 ms, from its arrival), the run gains 2 gaps
    r = closed_loop(cfg(), fixed_engine(), concurrency=1, n=3, isl=4, osl=2, client_gap_s=0.005)
    assert list(r.ttft) == pytest.approx([STEP] * 3)
    assert r.steps == 6
    assert r.makespan_s == pytest.approx(6 * STEP + 2 * 0.005)


def test_closed_loop_per_request_gaps_stagger_even_the_first_wave():
    # A arrives at 0 (first token 10 ms); B arrives at 5 ms, mid-step: it joins at the next turn (10 ms) and
    # shares A's generation step, first token at 20 ms -> TTFT 15 ms. Results come in submission order.
    r = closed_loop(cfg(), fixed_engine(), concurrency=2, n=2, isl=4, osl=2, client_gap_s=[0.0, 0.005])
    assert list(r.ttft) == pytest.approx([STEP, 1.5 * STEP])
    assert list(r.queue_wait) == pytest.approx([0.0, 0.5 * STEP])  # B left the queue at the 10 ms turn
    assert list(r.executor_ttft) == pytest.approx([STEP, STEP])
    with pytest.raises(ValueError, match="1 values for 2 requests"):
        closed_loop(cfg(), fixed_engine(), concurrency=2, n=2, isl=4, osl=2, client_gap_s=[0.0])


def test_closed_loop_step_gap_is_shared_by_the_requests_one_step_frees():
    # A and B run in lockstep (0-20 ms) and free their clients in the same step, which draws one shared delay
    # (5 ms); each request adds its own gap (0 and 3 ms): C arrives at 25 ms to an idle executor and starts at
    # once; D arrives at 28 ms, mid-step, and waits for the 35 ms turn
    r = closed_loop(
        cfg(),
        fixed_engine(),
        concurrency=2,
        n=4,
        isl=4,
        osl=2,
        client_gap_s=[0.0, 0.0, 0.0, 0.003],
        step_gap_s=[0.005, 0.0, 0.0, 0.0],
    )
    assert list(r.ttft[:2]) == pytest.approx([STEP, STEP])
    assert list(r.queue_wait) == pytest.approx([0.0, 0.0, 0.0, 0.007])
    shared = closed_loop(
        cfg(), fixed_engine(), concurrency=2, n=4, isl=4, osl=2, client_gap_s=[0.0] * 4, step_gap_s=[0.005] * 4
    )
    assert list(shared.queue_wait) == pytest.approx([0.0] * 4)  # a group that comes back together starts together
    assert shared.makespan_s == pytest.approx(4 * STEP + 0.005)
    with pytest.raises(ValueError, match="step_gap_s has 1 values for 4 requests"):
        closed_loop(cfg(), fixed_engine(), concurrency=2, n=4, isl=4, osl=2, step_gap_s=[0.0])


def test_simulated_prompts_share_no_prefix_even_with_kv_reuse_on():
    # benchmark prompts are distinct: with reuse enabled every request still computes its whole prompt
    seen = []
    engine = CostModelEngine(step_cost=lambda b: (seen.append(sum(len(e.tokens) for e in b.entries)) or STEP, "fixed"))
    config = executor_config(
        max_batch_size=1,
        max_num_tokens=256,
        max_input_len=256,
        max_seq_len=256,
        kv_tokens=4096,
        tokens_per_block=16,
        enable_chunked_context=True,
        enable_kv_cache_reuse=True,
    )
    closed_loop(config, engine, concurrency=1, n=3, isl=64, osl=2)
    assert seen == [64, 1, 64, 1, 64, 1]


def test_poisson_arrivals_far_apart_never_queue():
    r = poisson(cfg(), fixed_engine(), rate=1.0, n=5, isl=4, osl=2, seed=3)
    assert len(r.ttft) == 5
    assert list(r.ttft) == pytest.approx([STEP] * 5, abs=1e-9)
    assert r.steps == 10
    again = poisson(cfg(), fixed_engine(), rate=1.0, n=5, isl=4, osl=2, seed=3)
    assert again.makespan_s == r.makespan_s  # seeded: the same arrivals
    # and the seed decides them: the last arrival is a sum of continuous exponential gaps, so another seed ends at
    # the same float only by a collision of doubles (probability ~2^-52); a seed ignored would give the same
    other = poisson(cfg(), fixed_engine(), rate=1.0, n=5, isl=4, osl=2, seed=4)
    assert other.makespan_s != r.makespan_s


def test_roofline_engine_charges_the_cost_model_time():
    d = Deployment(published_spec("Llama 3.1 8B"), get_gpu("h100"), "fp8", "fp8")
    c = Constants()
    eng = CostModelEngine(d, c)
    batch = StepBatch(
        0,
        [
            StepEntry(1, [5] * 100, 0, [0, 1], True, True),
            StepEntry(2, [5], 300, [2, 3, 4, 5, 6], False, True),
            StepEntry(3, [5], 300, [7, 8, 9, 10, 11], False, True),
        ],
    )
    res = eng.step(batch)
    want = step_time(group_terms(d, [(0, 100, 1.0)], [(300, 2.0)], 3), c)
    assert res.elapsed_s == pytest.approx(want, rel=1e-12)
    assert set(res.tokens) == {1, 2, 3}
