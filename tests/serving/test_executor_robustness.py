"""The executor under faults, deadlines, priorities and a full queue, driven turn by turn (ExecutorCore, no
threads racing) or, for the loop's own death, through the threaded Executor: requests fail alone with an error
that says why, lower priorities wait, are paused and are shed first, FIFO among equals, and every block comes back."""

from __future__ import annotations

import threading

import pytest

from trtpipe.serving.api import CapacityPolicy, ErrorKind, FinishReason, Request, StepResult
from trtpipe.serving.executor import Executor, ExecutorCore, ExecutorStopped, QueueFullError, SimClock
from trtpipe.serving.reference_engine import ReferenceEngine

from serving_oracle import check_greedy, small_config

PROMPT = [1, 403, 407, 261, 378]


_config = small_config


class _Untimed(ReferenceEngine):
    """Real tokens, no cost in simulated time: the test alone moves the SimClock."""

    def step(self, batch):
        return StepResult(super().step(batch).tokens, 0.0)


def _core(model, config, engine=None, clock=None):
    finals, order = {}, []

    def on_response(r):
        if r.is_final:
            finals[r.request_id] = r
            order.append(r.request_id)

    core = ExecutorCore(config, engine or _Untimed(model), on_response, clock=clock or SimClock())
    return core, finals, order


def test_requests_past_their_allotted_time_fail_queued_or_running_and_the_rest_finish(model_tp1, oracle):
    clock = SimClock()
    core, finals, _ = _core(model_tp1, _config(max_batch_size=2, request_timeout_s=5.0), clock=clock)
    keep = core.submit(Request(PROMPT, 40, allotted_time_s=1000.0, exclude_input_from_output=True))
    running = core.submit(Request(PROMPT, 40, streaming=True))
    queued = core.submit(Request(PROMPT, 4))
    for _ in range(3):
        core.iterate()
    assert queued not in finals and running not in finals and len(core.active) == 2
    clock.advance(6.0)  # past the recipe's 5 s for the two without their own allotment
    core.iterate()
    for rid, where in ((queued, "in the queue"), (running, "while generating")):
        r = finals[rid]
        assert r.error_kind is ErrorKind.TIMED_OUT and r.finish_reason == FinishReason.TIMED_OUT
        assert f"Request timed out {where}: not finished 6.00 s after it arrived (allotted time 5 s)" in r.error
    core.run_until_idle()
    assert not finals[keep].has_error and check_greedy(model_tp1, oracle, PROMPT, finals[keep].tokens, 40) == ""
    assert core.pool.num_free == core.pool.num_blocks


def test_admission_is_by_priority_and_fifo_among_equals(model_tp1):
    core, _, order = _core(model_tp1, _config(max_batch_size=1))
    ids = {
        name: core.submit(Request(PROMPT, 2, priority=p))
        for name, p in (("a", 0.5), ("b", 0.2), ("c", 0.5), ("d", 0.8), ("e", 0.2), ("f", 0.5))
    }
    core.run_until_idle()
    assert order == [ids[n] for n in "dacfbe"]


def test_a_full_queue_sheds_its_lowest_priority_newest_first_and_refuses_the_rest(model_tp1):
    core, finals, order = _core(model_tp1, _config(max_batch_size=1, max_queue_size=3))
    running = core.submit(Request(PROMPT, 3))
    core.iterate()  # admitted: the queue is empty again
    low1, low2, mid = (core.submit(Request(PROMPT, 3, priority=p)) for p in (0.1, 0.1, 0.5))
    assert core.refusal(0.1) and core.refusal(0.5) is None  # what submit would say, asked before tokenizing
    high1 = core.submit(Request(PROMPT, 3, priority=0.9))  # full: pushes out the newest of the lowest (low2)
    with pytest.raises(QueueFullError, match="Maximum queue size of 3 has been reached"):
        core.submit(Request(PROMPT, 3, priority=0.1))  # nothing lower than itself to shed
    high2 = core.submit(Request(PROMPT, 3, priority=0.9))  # sheds low1
    core.run_until_idle()
    for shed in (low2, low1):
        assert finals[shed].error_kind is ErrorKind.OVERLOADED and "please try again later" in finals[shed].error
    assert order[:2] == [low2, low1]  # answered at the next turn
    assert order[2:] == [running, high1, high2, mid]
    assert all(not finals[i].has_error for i in (running, high1, high2, mid))


def _pauses(model, priorities):
    """Two long requests over a pool too small for both: the first submitted starts alone, the second joins."""
    config = _config(capacity_policy=CapacityPolicy.MAX_UTILIZATION, num_blocks=12, max_seq_len=96, max_num_tokens=96)
    core, finals, _ = _core(model, config)
    first = core.submit(
        Request(PROMPT + list(range(10, 25)), 60, priority=priorities[0], exclude_input_from_output=True)
    )
    for _ in range(3):
        core.iterate()
    second = core.submit(
        Request(PROMPT + list(range(30, 45)), 60, priority=priorities[1], exclude_input_from_output=True)
    )
    pauses = {first: 0, second: 0}
    while core.iterate():
        for r in core.active:
            pauses[r.id] = r.num_pauses
    assert core.pool.num_free == core.pool.num_blocks
    return [pauses[first], pauses[second]], [finals[first].tokens, finals[second].tokens]


def test_max_utilization_pauses_the_lowest_priority_not_the_latest(model_tp1, oracle):
    equal, _ = _pauses(model_tp1, (0.5, 0.5))
    assert equal[0] == 0 and equal[1] > 0  # equal priorities: the later request is the one paused
    ranked, tokens = _pauses(model_tp1, (0.2, 0.9))
    assert ranked[0] > 0 and ranked[1] == 0  # the high-priority newcomer runs; the running low one is paused
    prompts = [PROMPT + list(range(10, 25)), PROMPT + list(range(30, 45))]
    for p, t in zip(prompts, tokens):  # paused and recomputed, the answers are still transformers' greedy ones
        assert check_greedy(model_tp1, oracle, p, t, 60) == ""


class _FailsOnce(_Untimed):
    def step(self, batch):
        if batch.iteration == 2:
            raise RuntimeError("device lost")
        return super().step(batch)


def test_a_failed_step_fails_the_requests_it_carried_only(model_tp1, oracle):
    core, finals, _ = _core(model_tp1, _config(max_batch_size=2), engine=_FailsOnce(model_tp1))
    carried = [core.submit(Request(PROMPT, 10)) for _ in range(2)]
    waiting = core.submit(Request(PROMPT, 10, exclude_input_from_output=True))  # queued behind the batch of 2
    core.run_until_idle()
    for rid in carried:
        assert finals[rid].error_kind is ErrorKind.INTERNAL
        assert "Encountered an error in forwardAsync function: RuntimeError: device lost" in finals[rid].error
    assert not finals[waiting].has_error and check_greedy(model_tp1, oracle, PROMPT, finals[waiting].tokens, 10) == ""
    assert core.pool.num_free == core.pool.num_blocks


class _Dies(ReferenceEngine):
    """An engine whose step ends the thread with something no ``except Exception`` holds (as SystemExit does)."""

    def step(self, batch):
        if batch.iteration == 3:
            raise SystemExit("engine process gone")
        return super().step(batch)


def test_a_loop_that_dies_turns_unhealthy_answers_everyone_and_refuses_new_work(model_tp1):
    ex = Executor(_config(max_batch_size=1), _Dies(model_tp1))
    try:
        assert ex.healthy
        finals, done = {}, threading.Event()

        def collect(r):
            if r.is_final:
                finals[r.request_id] = r
                if len(finals) == 2:
                    done.set()

        ids = [ex.submit(Request(PROMPT, 20, streaming=True), collect) for _ in range(2)]  # one running, one queued
        assert done.wait(120)
        assert not ex.healthy and "SystemExit: engine process gone" in ex.stopped_because
        for rid in ids:
            assert finals[rid].has_error and "Executor stopped (the executor loop died" in finals[rid].error
        with pytest.raises(ExecutorStopped, match="engine process gone"):
            ex.submit(Request(PROMPT, 2), collect)
    finally:
        ex.shutdown()


def test_drain_time_is_the_queue_over_the_recent_finish_rate(model_tp1):
    """Retry-After's source: requests finishing one per simulated second, three queued behind the running one ->
    (3 + 1) / 1 = 4 s; nothing is known before two have finished."""
    clock = SimClock()
    core, finals, _ = _core(model_tp1, _config(max_batch_size=1), clock=clock)
    assert core.drain_time_s() is None
    for _ in range(3):
        core.submit(Request(PROMPT, 1))
        core.iterate()  # admitted and stepped: its one token ends it
        clock.advance(1.0)
        core.iterate()  # answered (finished at this turn's clock)
    assert len(finals) == 3 and core.drain_time_s() == pytest.approx(1.0)  # an empty queue: one request's time
    for _ in range(3):
        core.submit(Request(PROMPT, 1))
    assert core.drain_time_s() == pytest.approx(4.0)
