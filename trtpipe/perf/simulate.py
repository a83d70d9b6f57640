"""The serving simulator: the executor that serves (:class:`~trtpipe.serving.executor.ExecutorCore`) driven in
simulated time by the cost model instead of the reference runtime.

:class:`CostModelEngine` is a :class:`~trtpipe.serving.api.StepEngine` whose ``step`` returns the cost model's
time for the packed batch it is handed (context chunks at their positions, generating requests at their KV
lengths) and a token that is never the end id, so every request runs to its output length. Admission, capacity
policy, chunking, the KV block pool and the perf-metric timestamps are the executor's own code: a simulated curve
and a served curve differ only by step costs.

Workloads: ``max_load`` (all requests at t=0), ``closed_loop`` (N clients, each sends its next request when the
last one finishes), ``poisson`` (open-loop arrivals at a rate, seeded).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from trtpipe.perf.cost import Constants, Deployment, bound, group_terms, step_time
from trtpipe.serving.api import ExecutorConfig, Request, Response, StepBatch, StepResult
from trtpipe.serving.executor import ExecutorCore, SimClock

TOKEN = 1  # what every simulated step samples; requests are submitted without an end id


class CostModelEngine:
    """A step engine that computes time instead of tokens. ``step_cost`` may be swapped (e.g. a fitted CPU model)."""

    def __init__(
        self,
        deployment: Optional[Deployment] = None,
        constants: Constants = Constants(),
        step_cost: Optional[Callable[[StepBatch], tuple[float, str]]] = None,
    ):
        if step_cost is None and deployment is None:
            raise ValueError("CostModelEngine needs a deployment or a step_cost function")
        self.deployment, self.constants = deployment, constants
        self.step_cost = step_cost or self._roofline
        self.busy_s: Counter = Counter()  # simulated seconds per bound
        self.steps = 0
        self.scheduled: list[int] = []

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        pass  # the pool's accounting is the executor's; there is no storage to allocate

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        pass

    def _roofline(self, batch: StepBatch) -> tuple[float, str]:
        ctx = [(e.start_pos, len(e.tokens), 1.0) for e in batch.entries if e.is_context]
        gen = Counter(e.start_pos for e in batch.entries if not e.is_context)
        sampled = sum(1 for e in batch.entries if e.sample)
        t = group_terms(self.deployment, ctx, sorted(gen.items()), sampled)
        return float(step_time(t, self.constants)), bound(t, self.constants)

    def step(self, batch: StepBatch) -> StepResult:
        elapsed, why = self.step_cost(batch)
        self.busy_s[why] += elapsed
        self.steps += 1
        self.scheduled.append(len(batch.entries))
        return StepResult({e.request_id: TOKEN for e in batch.entries if e.sample}, elapsed)


@dataclass
class SimResult:
    """Per-request latencies (seconds) and totals of one simulated run."""

    ttft: np.ndarray
    itl: np.ndarray
    e2e: np.ndarray
    output_tokens: int
    makespan_s: float
    steps: int
    mean_batch: float
    busy_s: dict = field(default_factory=dict)
    slots_full: float = 0.0  # fraction of steps that ran max_batch_size requests
    kv_stalled: float = 0.0  # fraction of steps that could not admit a waiting request for lack of KV blocks
    queue_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))  # arrival -> left the executor queue (s)

    @property
    def executor_ttft(self) -> np.ndarray:
        """First token - left the executor queue: TTFT as the backend's perf metrics report it."""
        return self.ttft - self.queue_wait

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def pct(self, name: str, q: float) -> float:
        a = getattr(self, name)
        return float(np.percentile(a, q)) if len(a) else float("nan")

    @property
    def step_bound(self) -> str:
        return max(self.busy_s, key=self.busy_s.get) if self.busy_s else ""

    @property
    def load_bound(self) -> str:
        """What capped the batch: batch slots, KV capacity, or neither (the offered load)."""
        if self.slots_full > 0.5:
            return "batch slots"
        if self.kv_stalled > 0.1:
            return "KV capacity"
        return "offered load"


class _Driver:
    def __init__(self, config: ExecutorConfig, engine: CostModelEngine):
        self.clock = SimClock()
        self.done: list[tuple[Response, int]] = []  # with the simulated time the response was sent
        self.core = ExecutorCore(config, engine, lambda r: self.done.append((r, self.clock.now_ns())), clock=self.clock)
        self.engine, self.config = engine, config
        self.arrival: dict[int, int] = {}
        self.finals: dict[int, Response] = {}
        self.final_at: list[int] = []  # when each final response was sent, in order
        self.slots_full = self.stalled = self.turns = 0

    def submit(self, isl: int, osl: int, at_ns: Optional[int] = None) -> int:
        # a distinct first token per request: benchmark prompts share no prefix, so KV reuse must not find one
        req = Request(
            prompt=[TOKEN + 1 + len(self.arrival)] + [TOKEN + 1] * (isl - 1),
            max_new_tokens=osl,
            return_perf_metrics=True,
        )
        rid = self.core.submit(req)
        self.arrival[rid] = self.clock.now_ns() if at_ns is None else at_ns
        return rid

    def turn(self) -> bool:
        more = self.core.iterate()
        self.turns += 1
        st = self.core.last_stats
        if len(self.core.active) >= self.config.max_batch_size:
            self.slots_full += 1
        elif self.core.queue and self.core.active:
            self.stalled += 1
        for r, at in self.done:
            if r.is_final:
                self.finals[r.request_id] = r
                self.final_at.append(at)
        self.done.clear()
        del st
        return more

    def result(self) -> SimResult:
        ttft, itl, e2e, queue, out = [], [], [], [], 0
        first = min(self.arrival.values()) if self.arrival else 0
        last = first
        for rid, r in sorted(self.finals.items()):  # submission order (ids are issued in order)
            p = r.perf
            if r.has_error or p is None:
                continue
            n = r.num_output_tokens
            out += n
            ttft.append((p.first_token_ns - self.arrival[rid]) / 1e9)
            queue.append((p.arrival_ns - self.arrival[rid]) / 1e9)
            e2e.append((p.last_token_ns - self.arrival[rid]) / 1e9)
            if n > 1:
                itl.append((p.last_token_ns - p.first_token_ns) / 1e9 / (n - 1))
            last = max(last, p.last_token_ns)
        e = self.engine
        steps = max(e.steps, 1)
        return SimResult(
            np.array(ttft),
            np.array(itl),
            np.array(e2e),
            out,
            (last - first) / 1e9,
            e.steps,
            float(np.mean(e.scheduled)) if e.scheduled else 0.0,
            dict(e.busy_s),
            self.slots_full / max(self.turns, 1),
            self.stalled / steps,
            np.array(queue),
        )


def max_load(config: ExecutorConfig, engine: CostModelEngine, n: int, isl: int, osl: int) -> SimResult:
    d = _Driver(config, engine)
    for _ in range(n):
        d.submit(isl, osl)
    while d.turn():
        pass
    return d.result()


def closed_loop(
    config: ExecutorConfig,
    engine: CostModelEngine,
    concurrency: int,
    n: int,
    isl: int,
    osl: int,
    client_gap_s: Union[float, Sequence[float]] = 0.0,
    step_gap_s: Optional[Sequence[float]] = None,
) -> SimResult:
    """``concurrency`` clients, n requests in all; each sends its next request when its previous one's final
    response leaves the executor. ``client_gap_s`` is the time outside the executor (network, tokenization,
    detokenization) before a request arrives: one number for every request after the first wave (which arrives
    at t=0), or one per request in submission order, the first wave included. Measured gaps vary from request
    to request, and that variation is what keeps real clients from moving in lockstep.

    ``step_gap_s``: one more delay per step that sends final responses, shared by every request those finals
    free (the k-th such step takes the k-th value), added to each one's ``client_gap_s``. A front end moves the
    requests that finish together as a group (measured on the served twin: requests freed by one step come back
    within a few ms of each other, groups tens of ms apart), and that is what keeps real clients *in* step."""
    d = _Driver(config, engine)
    per_request = not isinstance(client_gap_s, (int, float))
    gap_ns = [int(g * 1e9) for g in client_gap_s] if per_request else [int(client_gap_s * 1e9)] * n
    if len(gap_ns) < n:
        raise ValueError(f"client_gap_s has {len(gap_ns)} values for {n} requests")
    if step_gap_s is not None and len(step_gap_s) < n:  # at most one step per request sends finals
        raise ValueError(f"step_gap_s has {len(step_gap_s)} values for {n} requests")
    shared_ns = iter([int(g * 1e9) for g in step_gap_s]) if step_gap_s is not None else None
    on_the_way: list[int] = []  # arrival times of sent requests not yet at the executor
    sent = seen = 0
    for _ in range(min(concurrency, n)):
        if per_request:
            heapq.heappush(on_the_way, max(0, gap_ns[sent]))
        else:
            d.submit(isl, osl)
        sent += 1
    while True:
        while on_the_way and on_the_way[0] <= d.clock.now_ns():
            d.submit(isl, osl, heapq.heappop(on_the_way))
        more = d.turn()
        if seen < len(d.final_at) and sent < n:
            shared = 0 if shared_ns is None else next(shared_ns)
            while seen < len(d.final_at) and sent < n:
                heapq.heappush(on_the_way, d.final_at[seen] + max(0, shared + gap_ns[sent]))  # never before
                seen += 1
                sent += 1
        seen = len(d.final_at)
        if not more:
            if not on_the_way:
                break
            d.clock.advance(max(0, on_the_way[0] - d.clock.now_ns()) / 1e9)  # idle until the next arrival
    return d.result()


def poisson(
    config: ExecutorConfig, engine: CostModelEngine, rate: float, n: int, isl: int, osl: int, seed: int = 0
) -> SimResult:
    """Open-loop arrivals with exponential gaps at ``rate`` requests/s (seeded); rate inf = all at t=0."""
    if rate == float("inf"):
        return max_load(config, engine, n, isl, osl)
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(int(t * 1e9))
    heapq.heapify(arrivals)
    d = _Driver(config, engine)
    while True:
        now = d.clock.now_ns()
        while arrivals and arrivals[0] <= now:
            d.submit(isl, osl, heapq.heappop(arrivals))
        more = d.turn()
        if not more:
            if not arrivals:
                break
            d.clock.advance((arrivals[0] - d.clock.now_ns()) / 1e9)  # idle until the next arrival
    return d.result()
