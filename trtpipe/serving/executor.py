"""The in-flight batching executor: one loop that admits, schedules, runs one packed step and responds.

Between two engine steps, in TensorRT-LLM's order (``executionLoop``): time out requests past their allotted
time, apply cancellations, send responses (finished requests leave and free their blocks), admit from the priority
queue, run the capacity scheduler (pausing under MAX_UTILIZATION), the micro-batch scheduler, allocate KV blocks,
run the step. A request submitted while a step runs joins at the next step.

Priority is TensorRT-LLM's: a float, bigger is served first (default 0.5), FIFO among equals, in the queue, in the
active list (so MAX_UTILIZATION pauses the lowest priority first) and when a full queue sheds (the lowest, newest
first). Faults stay local: a request whose settings or admission fail, a context the micro-batch scheduler refuses,
and a failed step fail only the requests concerned; anything else fails what is in flight; the loop goes on.

:class:`ExecutorCore` is single-threaded and clock-agnostic: the served twin drives it from a thread with the
real clock (:class:`Executor`), the performance simulator drives it with a :class:`SimClock` that advances by
each step's simulated cost. Everything above the step engine is the same code in both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from trtpipe.serving.api import (
    CapacityPolicy,
    ErrorKind,
    ExecutorConfig,
    FinishReason,
    Request,
    Response,
    StepBatch,
    StepEngine,
    StepEntry,
)
from trtpipe.serving.guided import GuideError
from trtpipe.serving.adapters import within_lora_cache
from trtpipe.serving.draft_logits import external_draft_probs
from trtpipe.serving.kv_pool import BlockPool, KVStats
from trtpipe.serving.logprobs import MAX_LOGPROBS
from trtpipe.serving.scheduler import ActiveRequest, ContextTooLong, capacity_schedule, insert_by_priority, micro_batch
from trtpipe.serving.lookahead import request_problem as lookahead_problem
from trtpipe.serving.speculative import Speculator, count_verification
from trtpipe.serving.tree_verify import accepted_slot_moves


log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """``maxQueueSize`` reached: the request is refused at once (back-pressure)."""


class ExecutorStopped(RuntimeError):
    """The executor loop is not running (shut down, or died): nothing submitted now would ever be answered."""


class Clock:
    """Steady clock in nanoseconds (TensorRT-LLM's perf metrics are steady-clock too)."""

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def advance(self, seconds: float) -> None:
        """Real time advances by itself."""


class SimClock(Clock):
    """Simulated time: moves only when a step's simulated cost is added (or the simulator jumps to an arrival)."""

    def __init__(self, start_ns: int = 0):
        self.t = start_ns

    def now_ns(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += int(round(seconds * 1e9))


@dataclass
class IterationStats:
    """One record per step (``IterationStats``): what the backend's Prometheus gauges show."""

    iteration: int
    timestamp_ns: int
    num_active: int
    max_active: int
    num_queued: int
    num_scheduled: int
    num_context_requests: int
    num_context_tokens: int
    num_generation_requests: int
    num_paused: int
    step_time_s: float
    kv: KVStats
    num_attended_tokens: int = 0  # KV positions the step's attention read (context and generation rows)
    # (start position, tokens, is context) of each scheduled entry: what a step-cost model of the twin needs
    entries: tuple = ()

    @property
    def num_waiting(self) -> int:
        """Active but not scheduled this step (the backend's ``waiting``; not the executor queue)."""
        return self.num_active - self.num_scheduled


@dataclass
class _Queued:
    id: int
    request: Request
    enqueue_ns: int

    @property
    def priority(self) -> float:
        return self.request.priority


def _hits_stop(tokens: list[int], stop_words) -> bool:
    return any(w and len(tokens) >= len(w) and tokens[-len(w) :] == list(w) for w in stop_words)


def _scores_prompt(r: ActiveRequest) -> bool:
    """The request still needs prompt logprobs: its context runs from position 0 (no reused prefix), so every
    prompt position's logits pass through the step."""
    return r.request.prompt_logprobs is not None and len(r.prompt_logprobs) < r.prompt_len - 1


def _banned(r: ActiveRequest) -> Optional[int]:
    """The end id while the request has fewer than ``min_tokens`` output tokens (``minTokens``), else None."""
    req = r.request
    return req.end_id if req.min_tokens > 0 and len(r.output) < req.min_tokens else None


def _may_draft(r: ActiveRequest) -> bool:
    """Whether this step may verify drafts for ``r``: the twin's verification takes the target's plain rows, so a
    request with a grammar, logprobs, an adapter or a banned end id decodes one token per step (its output is the
    same either way; only its speed differs)."""
    req = r.request
    return r.matcher is None and req.logprobs is None and req.lora is None and _banned(r) is None


class ExecutorCore:
    """The executor without a thread. ``submit``/``cancel`` are thread-safe; ``iterate`` runs on one thread."""

    def __init__(
        self,
        config: ExecutorConfig,
        engine: StepEngine,
        on_response: Callable[[Response], None],
        clock: Optional[Clock] = None,
        stats_history: int = 1000,
        guided=None,
        draft_engine: Optional[StepEngine] = None,
    ):
        if config.max_beam_width != 1:
            raise ValueError("the executor runs beam width 1 only")
        need = -(-config.max_seq_len // config.tokens_per_block)
        if config.num_blocks < need:
            raise ValueError(
                f"KV pool of {config.num_blocks} blocks cannot hold one sequence of max_seq_len "
                f"{config.max_seq_len} ({need} blocks of {config.tokens_per_block} tokens)"
            )
        self.config, self.engine, self.on_response = config, engine, on_response
        self.guided = guided  # trtpipe.serving.guided.GuidedDecoder, or None: guided decoding off
        self.clock = clock or Clock()
        self.pool = BlockPool(config.num_blocks, config.tokens_per_block, config.enable_kv_cache_reuse)
        engine.allocate(config.num_blocks, config.tokens_per_block)
        self.max_active = config.max_batch_size
        self.queue: list[_Queued] = []
        self.active: list[ActiveRequest] = []
        self.iteration = 0
        self.iterations: deque[IterationStats] = deque(maxlen=stats_history)
        self.finished_lengths: deque[tuple[int, int]] = deque(maxlen=100_000)  # (input, output) per finished request
        self.finish_times_ns: deque[int] = deque(maxlen=64)  # when the last requests finished: the drain rate
        self._cancel: set[int] = set()
        self._lock = threading.Lock()  # guards queue, _cancel and ids against submit/cancel from other threads
        self._next_id = 1
        self._shed: list[_Queued] = []  # pushed out of a full queue by a higher priority: answered next turn
        self.stalled = False  # the last turn had requests but could schedule none (waiting for blocks)
        # speculative decoding (trtpipe.serving.speculative): drafts, verification, acceptance counters
        self.speculator = (
            Speculator(config, draft_engine, engine, self.pool) if config.speculative_decoding_type else None
        )

    # ---- the front ends' side (any thread) ------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request; ``QueueFullError`` at once when the queue is full of requests of its priority or higher.

        A full queue holding a lower priority sheds its lowest (the newest among equals) to make room: that one
        is answered with an ``OVERLOADED`` error at the next turn, as a refusal would have been.
        """
        with self._lock:
            limit = self.config.max_queue_size
            if limit > 0 and len(self.queue) + 1 > limit:
                if not self.queue or self.queue[-1].priority >= request.priority:
                    raise QueueFullError(f"Maximum queue size of {limit} has been reached, please try again later")
                self._shed.append(self.queue.pop())
            rid, self._next_id = self._next_id, self._next_id + 1
            insert_by_priority(self.queue, _Queued(rid, request, self.clock.now_ns()))
            return rid

    def refusal(self, priority: float) -> Optional[str]:
        """What :meth:`submit` would refuse a request of ``priority`` with right now, or None: lets a front end
        answer an overload before it tokenizes the prompt (advisory: ``submit`` still decides)."""
        with self._lock:
            limit = self.config.max_queue_size
            if limit > 0 and len(self.queue) >= limit and (not self.queue or self.queue[-1].priority >= priority):
                return f"Maximum queue size of {limit} has been reached, please try again later"
            return None

    def drain_time_s(self) -> Optional[float]:
        """How long the queue as it stands takes to drain at the rate the last (up to 64) requests finished; None
        before two have finished. What a refused client is told to wait (``Retry-After``)."""
        times = list(self.finish_times_ns)  # one atomic copy: the loop appends meanwhile
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        rate = (len(times) - 1) / ((times[-1] - times[0]) / 1e9)  # requests per second
        with self._lock:
            queued = len(self.queue)
        return (queued + 1) / rate

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._cancel.add(request_id)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self.active or self.queue or self._cancel or self._shed)

    @property
    def last_stats(self) -> Optional[IterationStats]:
        return self.iterations[-1] if self.iterations else None

    # ---- the loop (one thread) ------------------------------------------------------------------
    def iterate(self) -> bool:
        """One turn of the loop. Returns whether anything is left to do. Never raises for an ``Exception``."""
        try:
            was_active = bool(self.active)
            self._answer_shed()
            self._expire()
            self._apply_cancellations()
            self._respond()
            if was_active and not self.active:
                self._record(0.0, StepBatch(self.iteration), paused=0)  # the "all zero" record: gauges fall to 0
            self._admit()
            if self.active:
                self._step()
        except Exception as exc:  # a fault outside the guarded parts: fail what is in flight, keep the loop
            log.exception("executor iteration %d failed", self.iteration)
            self.fail_everything(f"Encountered an error in the executor loop: {type(exc).__name__}: {exc}")
            self.iteration += 1
        return self.busy

    def run_until_idle(self, max_iterations: int = 10_000_000) -> None:
        for _ in range(max_iterations):
            if not self.iterate():
                return
        raise RuntimeError(f"executor still busy after {max_iterations} iterations")

    # ---- shedding, deadlines, cancellation and responses -----------------------------------------
    def _answer_shed(self) -> None:
        with self._lock:
            shed, self._shed = self._shed, []
        limit = self.config.max_queue_size
        for q in shed:
            self._error(
                q.id,
                q.request,
                f"Maximum queue size of {limit} has been reached, please try again later "
                f"(shed for a request of higher priority than {q.priority:g})",
                ErrorKind.OVERLOADED,
            )

    def _allotted_ns(self, request: Request) -> int:
        t = request.allotted_time_s if request.allotted_time_s is not None else self.config.request_timeout_s
        return int(t * 1e9) if t and t > 0 else 0

    def _expire(self) -> None:
        """Requests past their allotted time (counted from submit) end with ``TIMED_OUT``, queued or running."""
        now = self.clock.now_ns()
        with self._lock:
            late = [
                q
                for q in self.queue
                if self._allotted_ns(q.request) and now - q.enqueue_ns > self._allotted_ns(q.request)
            ]
            if late:
                gone = {q.id for q in late}
                self.queue = [q for q in self.queue if q.id not in gone]
        for q in late:
            self._error(
                q.id,
                q.request,
                self._timeout_message(q.request, now - q.enqueue_ns, "in the queue"),
                ErrorKind.TIMED_OUT,
                FinishReason.TIMED_OUT,
            )
        for r in self.active:
            allotted = self._allotted_ns(r.request)
            if allotted and not r.finish_reason and now - r.perf.enqueue_ns > allotted:
                r.finish_reason = FinishReason.TIMED_OUT

    def _timeout_message(self, request: Request, waited_ns: int, where: str) -> str:
        return (
            f"Request timed out {where}: not finished {waited_ns / 1e9:.2f} s after it arrived "
            f"(allotted time {self._allotted_ns(request) / 1e9:g} s)"
        )

    def _apply_cancellations(self) -> None:
        with self._lock:
            ids, self._cancel = self._cancel, set()
            dropped = [q for q in self.queue if q.id in ids]
            self.queue = [q for q in self.queue if q.id not in ids]
        for q in dropped:  # never admitted: answer with the prompt only, as a cancelled request
            self._send(
                Response(
                    q.id,
                    [] if q.request.streaming or q.request.exclude_input_from_output else list(q.request.prompt),
                    True,
                    FinishReason.CANCELLED,
                    num_input_tokens=len(q.request.prompt),
                    client_tag=q.request.client_tag,
                )
            )
        for r in self.active:
            if r.id in ids and not r.finish_reason:
                r.finish_reason = FinishReason.CANCELLED
                del r.tokens[r.prompt_len :]  # generated tokens are dropped; only the prompt stays
                del r.logprobs[:]

    def _respond(self) -> None:
        keep = []
        now = self.clock.now_ns()
        for r in self.active:
            done = bool(r.finish_reason)
            req = r.request
            if r.finish_reason == FinishReason.TIMED_OUT:
                where = "while generating" if r.output else "before its first token"
                self._error(
                    r.id,
                    req,
                    self._timeout_message(req, now - r.perf.enqueue_ns, where),
                    ErrorKind.TIMED_OUT,
                    FinishReason.TIMED_OUT,
                )
            elif req.streaming:
                new = r.output[r.sent :]
                if new or done:
                    self._send(self._response(r, new, done, r.sent))
                    r.sent = len(r.output)
            elif done:
                out = r.output if req.exclude_input_from_output else r.tokens
                self._send(self._response(r, list(out), True, 0))
            if done:
                self._release(r)
                self.finished_lengths.append((r.prompt_len, len(r.output)))
                self.finish_times_ns.append(now)
            else:
                keep.append(r)
        self.active = keep

    def _response(self, r: ActiveRequest, tokens: list[int], final: bool, first_output: int = 0) -> Response:
        """``first_output``: the index in the output of the first output token this response carries."""
        req = r.request
        resp = Response(
            r.id,
            tokens,
            final,
            FinishReason(r.finish_reason) if final else FinishReason.NOT_FINISHED,
            perf=r.perf if (final and req.return_perf_metrics) else None,
            num_input_tokens=r.prompt_len,
            num_output_tokens=len(r.output),
            client_tag=req.client_tag,
        )
        if req.logprobs is not None:
            resp.logprobs = r.logprobs[first_output:]
            resp.cum_log_prob = r.cum_log_prob
        if req.return_generation_logits:
            resp.generation_logits = r.generation_logits[first_output:]
        if req.prompt_logprobs is not None and not r.prompt_logprobs_sent:
            resp.prompt_logprobs = [None, *r.prompt_logprobs]
            r.prompt_logprobs_sent = True
        return resp

    def _send(self, response: Response) -> None:
        try:
            self.on_response(response)
        except Exception:  # a front end that cannot deliver (client gone) must not stop the loop for everyone
            log.exception("response %d could not be delivered", response.request_id)

    def _error(
        self,
        rid: int,
        request: Request,
        message: str,
        kind: ErrorKind = ErrorKind.INTERNAL,
        reason: FinishReason = FinishReason.NOT_FINISHED,
    ) -> None:
        self._send(
            Response(
                rid,
                [],
                True,
                reason,
                error=message,
                error_kind=kind,
                num_input_tokens=len(request.prompt),
                client_tag=request.client_tag,
            )
        )

    def _release(self, r: ActiveRequest) -> None:
        """Publish the sequence's full blocks for reuse (prompt and output), then free them."""
        if r.block_table:
            self.pool.store(r.block_table, r.tokens[: r.kv_len], r.request.lora)
            self.pool.release(r.block_table)
            r.block_table = []
        if self.speculator is not None:
            self.speculator.forget(r.id)

    # ---- admission ---------------------------------------------------------------------------------
    def _admit(self) -> None:
        with self._lock:
            room = self.max_active - len(self.active)
            taken = []
            while self.queue and room > 0:
                taken.append(self.queue.pop(0))
                room -= 1
            if self.active or taken:  # priority overflow: strictly higher than the lowest active priority
                floor = min([a.priority for a in self.active] + [q.priority for q in taken])
                while self.queue and self.queue[0].priority > floor:
                    taken.append(self.queue.pop(0))
        for q in taken:
            problem, kind = self._validate(q.request), ErrorKind.INVALID
            if problem is None:
                try:
                    insert_by_priority(self.active, self._activate(q))
                    continue
                except GuideError as exc:  # a guide that does not compile (bad schema): this request's fault
                    problem, kind = str(exc), ErrorKind.INVALID
                except Exception as exc:  # one request's bad settings must not end the loop for every other one
                    log.exception("request %d could not be admitted", q.id)
                    problem, kind = f"{type(exc).__name__}: {exc}", ErrorKind.INTERNAL
            self._error(q.id, q.request, f"Encountered an error when fetching new request: {problem}", kind)

    def _validate(self, req: Request) -> Optional[str]:
        c = self.config
        if len(req.prompt) < 1:
            return "the prompt is empty"
        sampling = req.sampling.problem()
        if sampling:
            return sampling
        if req.max_new_tokens < 1:
            return f"max_new_tokens must be at least 1, got {req.max_new_tokens}"
        if req.guide is not None and self.guided is None:
            return "Guided decoding is not enabled: the server was started without a guided_decoding_backend"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(req, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                return f"{name} must be None or in [0, {MAX_LOGPROBS}], got {k!r}"
        if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or req.min_tokens < 0:
            return f"min_tokens must be an integer >= 0, got {req.min_tokens!r}"
        lookahead = lookahead_problem(c, req)
        if lookahead:
            return lookahead
        if len(req.prompt) > c.max_input_len:
            return f"Prompt length ({len(req.prompt)}) exceeds maximum input length ({c.max_input_len})."
        if not c.enable_chunked_context and len(req.prompt) > c.max_num_tokens:
            return (
                f"Prompt length ({len(req.prompt)}) exceeds max_num_tokens ({c.max_num_tokens}) and chunked "
                f"context is disabled: enable chunked context or raise max_num_tokens."
            )
        if (
            req.streaming
            and c.capacity_policy is not CapacityPolicy.GUARANTEED_NO_EVICT
            and not c.enable_chunked_context
            and len(req.prompt) + req.max_new_tokens - 1 > c.max_input_len
        ):
            return (
                "Request sequence length is potentially greater than max input length. This cannot be run "
                "with streaming, a pausing capacity policy and chunked context disabled."
            )
        return None

    def _activate(self, q: _Queued) -> ActiveRequest:
        req, c = q.request, self.config
        max_new = min(req.max_new_tokens, c.max_seq_len - len(req.prompt))  # silently shortened, as TRT-LLM does
        r = ActiveRequest(q.id, req, list(req.prompt), len(req.prompt), max_new)
        r.perf.enqueue_ns, r.perf.arrival_ns = q.enqueue_ns, self.clock.now_ns()
        if req.sampling.seed is not None and not req.sampling.greedy:
            import torch

            r.generator = torch.Generator().manual_seed(int(req.sampling.seed))
        if req.guide is not None:
            r.matcher = self.guided.matcher(req.guide)  # compiled (or cached) here: GuideError fails it alone
        return r

    # ---- one step ----------------------------------------------------------------------------------
    def _step(self) -> None:
        """Schedule and run one step. A context the micro-batch scheduler refuses fails alone; a failed step fails
        the requests it carried (TensorRT-LLM fails every active request: here the others go on)."""
        try:
            decision, chosen = self._schedule()
        except ContextTooLong as exc:
            self._fail(
                [r for r in self.active if r.id == exc.request_id],
                f"Encountered an error in scheduling: {exc}",
                ErrorKind.INVALID,
            )
            return
        except Exception as exc:
            log.exception("scheduling iteration %d failed", self.iteration)
            self._fail(list(self.active), f"Encountered an error in scheduling: {type(exc).__name__}: {exc}")
            self.iteration += 1
            return
        try:
            self._run(decision, chosen)
        except Exception as exc:
            log.exception("step %d failed", self.iteration)
            self._fail(chosen, f"Encountered an error in forwardAsync function: {type(exc).__name__}: {exc}")
            self.iteration += 1

    def _schedule(self):
        c, tpb = self.config, self.config.tokens_per_block
        for r in self.active:  # what the cache already holds of each first context
            if not r.started and not _scores_prompt(r):
                r.context_pos = len(self.pool.match_prefix(r.tokens[: r.context_len], r.request.lora)) * tpb
        decision = capacity_schedule(self.active, self.pool.num_free, c, self.max_active, self.pool.refs)
        for r in decision.paused:
            self._pause(r)
        return decision, within_lora_cache(micro_batch(decision.scheduled, c), c.max_loras)

    def _run(self, decision, chosen: list[ActiveRequest]) -> None:
        tpb = self.config.tokens_per_block
        self.stalled = False
        start = self.clock.now_ns()
        batch = StepBatch(self.iteration)
        contexts = [r for r in chosen if not r.generating]
        for r in contexts:  # reused prefixes first, so new allocations cannot evict a block matched this step
            if not r.started and not _scores_prompt(r):
                end = r.context_pos + r.chunk
                r.block_table = self.pool.take_prefix(r.tokens[: r.context_len], r.request.lora)
                r.context_pos = len(r.block_table) * tpb
                r.chunk = end - r.context_pos
                r.perf.kv_reused_blocks += len(r.block_table)
        for r in contexts:
            if r.perf.first_scheduled_ns == 0:
                r.perf.first_scheduled_ns, r.perf.first_iter = start, self.iteration
            new = self.pool.grow(r.block_table, r.context_len, prompt=True)
            r.perf.kv_alloc_new_blocks += new
            r.perf.kv_missed_blocks += new
            end = r.context_pos + r.chunk
            req = r.request
            drafts = self._context_drafts(r, end)
            r.perf.kv_alloc_new_blocks += self.pool.grow(r.block_table, r.context_len + len(drafts)) if drafts else 0
            r.perf.kv_alloc_total_blocks = len(r.block_table)
            batch.entries.append(
                StepEntry(
                    r.id,
                    r.tokens[r.context_pos : end] + drafts,
                    r.context_pos,
                    r.block_table,
                    True,
                    end == r.context_len,
                    req.sampling,
                    r.generator,
                    allowed=r.matcher.allowed() if r.matcher is not None and end == r.context_len else None,
                    lora=req.lora,
                    logprobs=req.logprobs,
                    prompt_logprobs=req.prompt_logprobs,
                    prompt_targets=(
                        r.tokens[r.context_pos + 1 : min(end + 1, r.prompt_len)] if _scores_prompt(r) else []
                    ),
                    banned=_banned(r),
                    draft_probs=external_draft_probs(req, len(drafts)),
                    context_drafts=len(drafts),
                    keep_logits=req.return_generation_logits,
                )
            )
        generating = [r for r in chosen if r.generating]
        drafting = [r for r in generating if _may_draft(r)]
        drafts = self.speculator.propose(drafting) if self.speculator is not None and drafting else {}
        for r in generating:
            # (drafts, their distributions[, a token set's StepEntry fields: trtpipe.serving.tree_verify.tree_fields])
            d, q, *spec = drafts.get(r.id, ([], None))
            new = self.pool.grow(r.block_table, r.kv_len + 1 + len(d))
            r.perf.kv_alloc_new_blocks += new
            r.perf.kv_alloc_total_blocks = len(r.block_table)
            batch.entries.append(
                StepEntry(
                    r.id,
                    [r.tokens[-1], *d],
                    r.kv_len,
                    r.block_table,
                    False,
                    True,
                    r.request.sampling,
                    r.generator,
                    allowed=r.matcher.allowed() if r.matcher is not None else None,
                    lora=r.request.lora,
                    logprobs=r.request.logprobs,
                    banned=_banned(r),
                    draft_probs=q,
                    **(spec[0] if spec and d else {}),
                    keep_logits=r.request.return_generation_logits,
                )
            )
        if not batch.entries:
            # nothing fits this turn (head-of-line blocked on KV): an empty record, then wait for the pool to change
            self._record(0.0, batch, len(decision.paused), 0)
            self.iteration += 1
            self.stalled = True
            return
        result = self.engine.step(batch)
        if self.speculator is not None:  # MTP / EAGLE-3 heads read the step's hidden states
            self.speculator.stepped(batch, result)
        self.clock.advance(result.elapsed_s)
        now = self.clock.now_ns()
        by_id = {r.id: r for r in chosen}
        failed = [by_id[i] for i in result.errors]
        for e in batch.entries:
            r = by_id[e.request_id]
            if e.request_id in result.errors:
                continue
            if e.is_context:
                r.context_pos += len(e.tokens) - e.context_drafts
                r.prompt_logprobs += result.prompt_logprobs.get(e.request_id, [])
                if not e.sample:
                    continue
                r.generating = True
                # early reuse: at the end of the context, keyed by the adapter (two adapters never share blocks)
                self.pool.store(r.block_table, r.tokens[: r.context_len], r.request.lora)
            if e.request_id in result.accepted:
                if e.request_id in result.kept:  # a masked verification: the accepted drafts' KV follows the prefix
                    self._keep_accepted(e, result.kept[e.request_id])
                self._accept_verified(r, e.drafts, result.accepted[e.request_id], now)
                continue
            if e.request_id in result.logits:  # return_generation_logits: the row its token was sampled from
                r.generation_logits.append(result.logits[e.request_id])
            try:
                self._accept(r, result.tokens[e.request_id], now, result.logprobs.get(e.request_id))
            except GuideError as exc:  # a token its grammar refuses (an engine that ignored the mask): its own
                result.errors[r.id] = str(exc)
                failed.append(r)
        self._record(result.elapsed_s, batch, len(decision.paused), len(chosen))
        self.iteration += 1
        for r in failed:  # one row's failure is its own: the others keep this step's tokens
            self._fail([r], f"Encountered an error in sampling request {r.id}: {result.errors[r.id]}")

    def _accept(self, r: ActiveRequest, token: int, now: int, logprob=None) -> None:
        """A sampled token: end id (not kept, nor its logprob), stop word (kept), or length ends the request."""
        if r.perf.first_token_ns == 0:
            r.perf.first_token_ns = now
        r.perf.last_token_ns, r.perf.last_iter = now, self.iteration
        req = r.request
        if r.matcher is not None:
            r.matcher.accept(token)
            if r.matcher.terminated:  # the grammar is complete and took its stop token: not kept, as an end id
                r.finish_reason = FinishReason.END_ID
                return
        if req.end_id is not None and token == req.end_id:
            r.finish_reason = FinishReason.END_ID
            return
        r.tokens.append(int(token))
        if logprob is not None:
            r.logprobs.append(logprob)
            r.cum_log_prob += logprob.logprob
        if req.stop_words and _hits_stop(r.output, req.stop_words):
            r.finish_reason = FinishReason.STOP_WORDS
        elif len(r.output) >= r.max_new_tokens:
            r.finish_reason = FinishReason.LENGTH

    def _accept_verified(self, r: ActiveRequest, drafts: list[int], emitted: list[int], now: int) -> None:
        """The tokens of one verification, in order, until one ends the request; then the blocks past the sequence
        go back to the pool (the rejected drafts' slots)."""
        for token in emitted:
            self._accept(r, token, now)
            if r.finish_reason:
                break
        count_verification(r.perf, self.speculator, drafts, emitted)
        keep = self.pool.blocks_for(len(r.tokens))
        if len(r.block_table) > keep:
            self.pool.release(r.block_table[keep:])
            del r.block_table[keep:]
        if self.speculator is not None:
            self.speculator.synced(r)

    def _keep_accepted(self, e: StepEntry, accepted: list[int]) -> None:
        """Move the accepted drafts' KV (written at ``start_pos`` + their index) to the positions after the entry's
        last token, in the engine (every rank) and in a drafter's per-position hidden states."""
        src, dst = accepted_slot_moves(e.block_table, e.start_pos, accepted, self.pool.tokens_per_block)
        if src:
            self.engine.move_slots(src, dst)
        if self.speculator is not None:
            self.speculator.kept(e.request_id, e.start_pos, accepted)

    def _context_drafts(self, r: ActiveRequest, end: int) -> list[int]:
        """The external drafts (``draft_input_ids``) the last chunk of a request's first context verifies: none for a
        request that may not draft, a recomputed context (after a pause) or when the pool lacks their blocks (the
        output is the same either way)."""
        d = list(r.request.draft_tokens)[: max(0, r.max_new_tokens - 1)]
        if not d or end != r.context_len or len(r.tokens) != len(r.request.prompt) or not _may_draft(r):
            return []
        if r.request.prompt_logprobs is not None:
            return []
        more = self.pool.blocks_for(r.context_len + len(d)) - len(r.block_table)
        return d if more <= self.pool.num_free else []

    def _pause(self, r: ActiveRequest) -> None:
        """MAX_UTILIZATION pause: drop the KV, keep the output, recompute prompt + output later (not a swap)."""
        self._release(r)
        r.generating, r.context_pos, r.context_len = False, 0, len(r.tokens)
        r.num_pauses += 1
        if _scores_prompt(r):  # its context is recomputed from position 0: score the prompt again
            r.prompt_logprobs = []
        if not self.config.enable_chunked_context and r.context_len > self.config.max_context_length:
            r.finish_reason = FinishReason.LENGTH  # its recompute could never be scheduled without chunking

    def _fail(self, requests: list[ActiveRequest], message: str, kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        """Answer ``requests`` with an error and drop them (their blocks go back to the pool)."""
        gone = {r.id for r in requests}
        self.active = [r for r in self.active if r.id not in gone]
        for r in requests:
            try:
                self._release(r)
            except Exception:  # a pool left inconsistent by the fault: the request still gets its answer
                log.exception("blocks of request %d not released", r.id)
                r.block_table = []
            self._error(r.id, r.request, message, kind)

    def fail_everything(self, message: str) -> None:
        """Answer every request, queued or in flight, with an error (the loop hit a fault, or is stopping)."""
        with self._lock:
            queued, self.queue, shed, self._shed = self.queue, [], self._shed, []
        self._fail(list(self.active), message)
        for q in queued + shed:
            self._error(q.id, q.request, message)

    def _record(self, elapsed: float, batch: StepBatch, paused: int, scheduled: Optional[int] = None) -> None:
        with self._lock:
            queued = len(self.queue)
        self.iterations.append(
            IterationStats(
                iteration=self.iteration,
                timestamp_ns=self.clock.now_ns(),
                num_active=len(self.active),
                max_active=self.max_active,
                num_queued=queued,
                num_scheduled=len(batch.entries) if scheduled is None else scheduled,
                num_context_requests=sum(1 for e in batch.entries if e.is_context),
                num_context_tokens=batch.num_context_tokens,
                num_generation_requests=batch.num_generation_requests,
                num_paused=paused,
                step_time_s=elapsed,
                kv=self.pool.stats(),
                num_attended_tokens=sum(e.start_pos + len(e.tokens) for e in batch.entries),
                entries=tuple((e.start_pos, len(e.tokens), e.is_context) for e in batch.entries),
            )
        )


class Executor:
    """:class:`ExecutorCore` on a background thread with the real clock, for servers and Python callers.

    ``submit(request, on_response)``: ``on_response(Response)`` runs on the executor thread, once per response;
    the last one has ``is_final``. ``QueueFullError`` is raised at once when the queue is full, ``ExecutorStopped``
    when the loop no longer runs. ``healthy`` turns false the moment the loop stops, whatever stopped it (a front
    end's health check reads it, so an orchestrator restarts the server); every request still waiting is then
    answered with an error.
    """

    def __init__(
        self,
        config: ExecutorConfig,
        engine: StepEngine,
        idle_wait_s: float = 0.05,
        threads: Optional[int] = None,
        guided=None,
        draft_engine: Optional[StepEngine] = None,
    ):
        self._callbacks: dict[int, Callable[[Response], None]] = {}
        self._cb_lock = threading.Lock()
        self.core = ExecutorCore(config, engine, self._dispatch, guided=guided, draft_engine=draft_engine)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle_wait = idle_wait_s
        self._threads = threads
        self.stopped_because: Optional[str] = None  # why the loop ended, once it has
        self.stopped = threading.Event()  # set when the loop has ended (stopped_because says why)
        self._thread = threading.Thread(target=self._loop, name="trtpipe-executor", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.stopped_because is None and self._thread.is_alive()

    def submit(self, request: Request, on_response: Callable[[Response], None]) -> int:
        with self._cb_lock:
            if not self.healthy:
                raise ExecutorStopped(f"the executor is not running: {self.stopped_because or 'its thread ended'}")
            rid = self.core.submit(request)
            self._callbacks[rid] = on_response
        self._wake.set()
        return rid

    def cancel(self, request_id: int) -> None:
        self.core.cancel(request_id)
        self._wake.set()

    def stats(self) -> Optional[IterationStats]:
        return self.core.last_stats

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def _dispatch(self, response: Response) -> None:
        with self._cb_lock:
            cb = (
                self._callbacks.pop(response.request_id)
                if response.is_final
                else self._callbacks.get(response.request_id)
            )
        if cb is not None:
            cb(response)

    def _loop(self) -> None:
        why = "shut down"
        try:
            if self._threads:  # torch's intra-op thread count is per thread: set it where the steps run
                import torch

                torch.set_num_threads(self._threads)
            while not self._stop.is_set():
                busy = self.core.iterate()
                if not busy or self.core.stalled:
                    self._wake.wait(self._idle_wait)
                    self._wake.clear()
        except BaseException as exc:  # iterate() contains every Exception: this is SystemExit, MemoryError, ...
            why = f"the executor loop died: {type(exc).__name__}: {exc}"
            log.critical("%s", why, exc_info=True)  # the thread ends here: healthy is false from now on
        finally:
            with self._cb_lock:  # no submit can slip in between: it checks healthy under this lock
                self.stopped_because = why
            self.stopped.set()
            try:
                self.core.fail_everything(f"Executor stopped ({why}); the request was not finished")
            except BaseException:  # pragma: no cover - answering is best effort once the loop is gone
                log.exception("requests left unanswered after the executor stopped")
