"""The CPU twin's step cost, fitted on its own iteration records, for the serving simulator.

``scripts/served_vs_sim.py`` measures the served twin and compares it with :func:`~trtpipe.perf.simulate.closed_loop`
driven by the step cost fitted here; README and docs/reference/perf-model.md quote that comparison. The logic those numbers
rest on lives here, as pure functions, so it is tested (tests/perf/test_step_fit.py) and the script is only a driver.

- :func:`step_features`: the terms of one step's time, following how the twin computes a step.
- :func:`robust_fit`: least squares with Huber weights, without negative terms (a typical step, not the stalls).
- :func:`fit_steps`: iteration records (``TRTPIPE_ITER_STATS``: TensorRT-LLM's IterationStats fields) to a
  :class:`StepFit` (coefficients, the measured steps' spread around them, the host time between steps).
- :class:`StepCost`: a fit as the simulator's ``step_cost`` (the typical time times a drawn spread, plus a gap).
- :func:`return_gaps`: a closed-loop client's time from a request's last token to its next arrival, grouped by
  the step that freed the requests; :class:`ByConcurrency`: a per-request time interpolated between concurrencies.
- :func:`compare_rounds`: measured against simulated, the medians and ratios the script's table prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from trtpipe.serving.api import StepBatch

FEATURES = (
    "base",
    "generating request",
    "context token",
    "context request",
    "context query-key pair",
    "gathered generation key",
)
# Huber's tuning constant (95 % efficiency under Gaussian noise) and the MAD -> sigma factor of a normal law
HUBER_K = 1.345
MAD_TO_SIGMA = 1.4826
IRLS_ROUNDS = 30


def step_features(entries: Iterable[tuple[int, int, bool]]) -> list[float]:
    """Step-cost terms from the step's (start position, tokens, is context) entries, following how the twin computes
    a step: a base cost; linear layers over all packed tokens (one per generating request, ``n`` per context
    chunk); per context request, its own attention over its queries times every key up to its end (cached prefix
    included) and a Python loop turn per layer; the generating rows' attention over one gathered
    [rows, longest position] block (padded to the longest). Order as :data:`FEATURES`."""
    entries = list(entries)
    ctx = [(start, n) for start, n, is_ctx in entries if is_ctx]
    gen = [start for start, _, is_ctx in entries if not is_ctx]
    return [
        1.0,
        float(len(gen)),
        float(sum(n for _, n in ctx)),
        float(len(ctx)),
        float(sum(n * (start + n) for start, n in ctx)),
        float(len(gen) * (max(gen) + 1) if gen else 0),
    ]


def batch_features(batch: StepBatch) -> list[float]:
    """:func:`step_features` of a simulated step."""
    return step_features((e.start_pos, len(e.tokens), e.is_context) for e in batch.entries)


def record_features(record: dict) -> list[float]:
    """:func:`step_features` of one iteration record (its ``scheduledEntries``: [start, tokens, is context])."""
    return step_features(tuple(e) for e in record["scheduledEntries"])


def robust_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients ``c >= 0`` of ``y ~ x @ c``: least squares with Huber weights (iteratively reweighted), so that
    the fit follows the typical step and the stalls of a shared machine stay in the spread around it (modelled
    apart, as noise); refitted without any term that came out negative (a negative cost is no cost model).
    Dropped terms are exactly 0."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        w = np.ones_like(y)
        for _ in range(IRLS_ROUNDS):
            c, *_ = np.linalg.lstsq(x[:, keep] * w[:, None], y * w, rcond=None)
            r = y - x[:, keep] @ c
            sigma = MAD_TO_SIGMA * np.median(np.abs(r - np.median(r))) + 1e-12
            w = np.sqrt(np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(r), 1e-12)))
        coef[keep] = c
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def busy_steps(records: Sequence[dict]) -> list[dict]:
    """The records of steps that computed something (an idle loop turn reports 0 ms)."""
    return [r for r in records if r["iterLatencyMS"] > 0]


def host_gaps(steps: Sequence[dict]) -> np.ndarray:
    """Seconds of host time between consecutive steps of a busy executor (loop, scheduling, handing responses
    over): the next step's start (its timestamp, taken at its end, minus its latency) minus this step's end, for
    consecutive iterations with requests active; clipped at 0 (the two clocks' rounding)."""
    gaps = [
        (b["timestamp"] - a["timestamp"]) / 1e9 - b["iterLatencyMS"] / 1e3
        for a, b in zip(steps, steps[1:])
        if b["iter"] == a["iter"] + 1 and a["numActiveRequests"] > 0
    ]
    return np.maximum(np.array(gaps, dtype=np.float64), 0.0)


@dataclass
class StepFit:
    """A fitted step cost: ``coef`` (seconds per :data:`FEATURES` term), ``ratios`` (each measured step over the
    fit: the spread, stalls included) and ``gaps`` (host seconds between steps)."""

    coef: np.ndarray
    ratios: np.ndarray
    gaps: np.ndarray

    def typical(self, features: Sequence[float]) -> float:
        """The fitted (typical) time of a step with these terms, in seconds."""
        return float(np.dot(features, self.coef))

    def summary(self) -> str:
        """One line: how well the fit follows the steps, and the fitted costs in readable units."""
        c, r, g = self.coef, self.ratios, self.gaps
        gap = f"median {np.median(g) * 1e3:.3f} ms mean {g.mean() * 1e3:.3f} ms" if g.size else "none measured"
        return (
            f"step cost: {len(r)} served steps; typical-step fit median |err| {np.median(np.abs(r - 1)):.1%}, "
            f"measured/fit p10 {np.percentile(r, 10):.2f} p90 {np.percentile(r, 90):.2f} mean {r.mean():.2f}; "
            f"base {c[0] * 1e3:.3f} ms, per generating request {c[1] * 1e6:.1f} us, per context token "
            f"{c[2] * 1e6:.2f} us, per context request {c[3] * 1e6:.1f} us, per context query-key pair "
            f"{c[4] * 1e9:.1f} ns, per gathered generation key {c[5] * 1e9:.1f} ns; host between steps {gap} "
            f"({len(g)})"
        )


def fit_steps(records: Sequence[dict]) -> StepFit:
    """Fit :func:`robust_fit` on the busy steps of iteration records (``iterLatencyMS`` the measured time)."""
    steps = busy_steps(records)
    if not steps:
        raise ValueError("no busy step among the iteration records: nothing to fit")
    x = np.array([record_features(r) for r in steps])
    y = np.array([r["iterLatencyMS"] / 1e3 for r in steps])
    coef = robust_fit(x, y)
    return StepFit(coef, y / (x @ coef), host_gaps(steps))


class StepCost:
    """A :class:`StepFit` as the simulator's ``step_cost``: the fitted time times a factor drawn from the measured
    steps' own spread around the fit (stalls of a shared machine included), plus a drawn host gap between steps.
    Seeded: the same simulation every run. A single step (TTFT) then sees the typical time and an average over
    many steps (ITL, throughput) the mean, as measured."""

    def __init__(self, fit: StepFit, seed: int = 0):
        self.fit = fit
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: StepBatch) -> tuple[float, str]:
        step = self.fit.typical(batch_features(batch)) * float(self.rng.choice(self.fit.ratios))
        return step + (float(self.rng.choice(self.fit.gaps)) if self.fit.gaps.size else 0.0), "cpu"


@dataclass
class ReturnGaps:
    """:func:`return_gaps`' answer: ``returns`` (seconds, one per request after the first wave), ``group`` (each
    freeing step's median over the overall median) and ``jitter`` (each request's offset from its step's median
    over the overall median, from steps that freed two or more)."""

    returns: np.ndarray
    group: np.ndarray
    jitter: np.ndarray


def return_gaps(arrivals_ns: Sequence[int], finals_ns: Sequence[int], concurrency: int) -> ReturnGaps:
    """Seconds from a request's last token to the next request's arrival, both on the executor's clock: what a
    closed-loop client spends outside the executor between two requests (final response path, the client's own
    turnaround, request path, the wait for the executor's next step). Matched first in, first out: with
    ``concurrency`` clients the k-th final frees the client of the (concurrency + k)-th arrival (the mean is exact
    under any matching).

    Requests freed by one step come back together (within a few ms; groups tens of ms apart): finals with the same
    timestamp are one step's, and the simulator draws one delay per step plus a small one per request."""
    arrivals, finals = np.sort(np.asarray(arrivals_ns, dtype=np.int64)), np.sort(np.asarray(finals_ns, dtype=np.int64))
    if len(arrivals) <= concurrency:
        raise ValueError(f"{len(arrivals)} requests at concurrency {concurrency}: no request followed another")
    gaps = (arrivals[concurrency:] - finals[: len(arrivals) - concurrency]) / 1e9
    typical = float(np.median(gaps))
    by_step: dict[int, list[float]] = {}
    for f, g in zip(finals, gaps):
        by_step.setdefault(int(f), []).append(float(g))
    medians = {k: float(np.median(v)) for k, v in by_step.items()}
    # from steps that freed two or more: a lone request's offset from itself is 0 and says nothing
    jitter = [g - medians[int(f)] for f, g in zip(finals, gaps) if len(by_step[int(f)]) > 1]
    return ReturnGaps(gaps, np.array(list(medians.values())) / typical, np.array(jitter, dtype=np.float64) / typical)


@dataclass
class ByConcurrency:
    """A per-request time measured at calibration points: its median at each calibration concurrency (the median
    over points with that concurrency), interpolated linearly in between (held flat outside), times a factor drawn
    from its pooled spread around those medians (each simulated request draws its own, as real requests differ).

    Build with :meth:`from_points` from ``(concurrency, per-request samples)`` pairs."""

    concurrencies: list[int]
    medians: list[float]
    spread: np.ndarray = field(repr=False)

    @classmethod
    def from_points(cls, points: Iterable[tuple[int, Sequence[float]]]) -> "ByConcurrency":
        points = [(int(c), np.asarray(v, dtype=np.float64)) for c, v in points]
        by_c: dict[int, list[float]] = {}
        for c, v in points:
            by_c.setdefault(c, []).append(float(np.median(v)))
        cs = sorted(by_c)
        return cls(cs, [float(np.median(by_c[c])) for c in cs], np.concatenate([v / np.median(v) for _, v in points]))

    def median_at(self, concurrency: float) -> float:
        return float(np.interp(concurrency, self.concurrencies, self.medians))

    def draw(self, concurrency: float, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.median_at(concurrency) * rng.choice(self.spread, size=n)

    def summary(self, name: str) -> str:
        return (
            f"{name}, median per calibration concurrency: "
            + ", ".join(f"c{c} {m * 1e3:.1f} ms" for c, m in zip(self.concurrencies, self.medians))
            + f"; spread p10 {np.percentile(self.spread, 10):.2f} p90 {np.percentile(self.spread, 90):.2f}"
        )


@dataclass
class Comparison:
    """One concurrency over rounds: ``measured`` and ``simulated`` medians per metric, and ``ratio`` the median of
    each round's simulated / measured (a round is predicted from its own calibration, so ratios are per round)."""

    concurrency: int
    measured: dict[str, float]
    simulated: dict[str, float]
    ratio: dict[str, float]


def compare_rounds(per_round: Sequence[dict], keys: Sequence[str]) -> list[Comparison]:
    """``per_round``: one {concurrency: (measured, simulated)} per round, each a {metric: value}. The concurrencies
    every round has, in order."""
    cs = sorted(set.intersection(*(set(x) for x in per_round))) if per_round else []
    out = []
    for c in cs:
        med = lambda i: {k: float(np.median([x[c][i][k] for x in per_round])) for k in keys}  # noqa: E731
        out.append(
            Comparison(
                c, med(0), med(1), {k: float(np.median([x[c][1][k] / x[c][0][k] for x in per_round])) for k in keys}
            )
        )
    return out


def worst_ratio_error(rows: Sequence[Comparison]) -> float:
    """max |simulated/measured - 1| over every row and metric: the one number the comparison is judged by."""
    return max((abs(v - 1) for r in rows for v in r.ratio.values()), default=0.0)
