"""``trtpipe bench compare A B``: per-metric deltas with a bootstrap confidence interval, and a gate.

For per-request metrics (ttft, itl, e2e, ...) each run keeps its per-request samples, so the delta of any
statistic (avg, p50, p99, ...) gets a percentile-bootstrap interval: both sides are resampled with
replacement (seeded), the statistic recomputed, and the 2.5/97.5 percentiles of the relative change taken.
One run per side covers request-to-request noise only; a side may be several runs of the same build
(``A1,A2,A3``), and then runs are resampled first, so run-to-run drift (a busy machine, a noisy neighbour)
widens the interval instead of passing for a change. Run-level numbers (throughputs) get an interval only
from repeated runs.

``--fail-if 'ttft.p99>+10%'`` fails (exit 1) when B's change crosses the threshold **and** the interval lies
entirely on that side of zero, i.e. the change is both large and not explained by the measured noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from trtpipe.bench.metrics import METRICS, BenchError
from trtpipe.bench.run import load_result

STATS = ("avg", "p50", "p90", "p99")
RUN_LEVEL = ("request_throughput", "output_token_throughput", "goodput", "good_request_fraction")


@dataclass(frozen=True)
class Gate:
    metric: str
    stat: str  # avg/pNN for per-request metrics, "value" for run-level ones
    op: str  # ">" (fail on increase) or "<" (fail on decrease)
    pct: float  # signed threshold in percent
    text: str


def parse_gate(text: str) -> Gate:
    """``ttft.p99>+10%`` / ``output_token_throughput<-5%`` / ``itl.avg>5%``."""
    m = re.fullmatch(r"\s*([a-z_][a-z0-9_]*)(?:\.([a-z0-9]+))?\s*([<>])\s*([+-]?[0-9]*\.?[0-9]+)\s*%\s*", text)
    if not m:
        raise BenchError(
            f"--fail-if: cannot read {text!r} (expected METRIC.STAT>+N% or METRIC<-N%, e.g. ttft.p99>+10%)"
        )
    metric, stat, op, pct = m.group(1), m.group(2), m.group(3), float(m.group(4))
    if metric not in METRICS:
        raise BenchError(f"--fail-if {text!r}: unknown metric {metric} (known: {', '.join(METRICS)})")
    if metric in RUN_LEVEL:
        stat = stat or "value"
        if stat != "value":
            raise BenchError(f"--fail-if {text!r}: {metric} is one number per run (write {metric}{op}{m.group(4)}%)")
    else:
        stat = stat or "p50"
        if stat != "avg" and not re.fullmatch(r"p\d{1,2}", stat):
            raise BenchError(f"--fail-if {text!r}: statistic must be avg or pNN, got {stat}")
    return Gate(metric, stat, op, pct, text.strip())


def _stat(a: np.ndarray, stat: str) -> float:
    return float(a.mean()) if stat == "avg" else float(np.percentile(a, float(stat[1:])))


def _runs(x) -> list[np.ndarray]:
    """One run (a flat sequence of samples) or several (a list of sequences) -> list of arrays."""
    if len(x) and isinstance(x[0], (list, tuple, np.ndarray)):
        return [np.asarray(r, dtype=np.float64) for r in x]
    return [np.asarray(x, dtype=np.float64)]


def _resample(runs: list[np.ndarray], rng, n: int, stat: str) -> np.ndarray:
    """``n`` bootstrap values of ``stat``: runs drawn with replacement (when there are several, so run-to-run
    drift is in the interval), then each drawn run's requests drawn with replacement, pooled."""
    k = len(runs)
    if k == 1:  # one run: vectorised
        r = runs[0]
        draws = r[rng.integers(0, r.size, size=(n, r.size))]
        return draws.mean(axis=1) if stat == "avg" else np.percentile(draws, float(stat[1:]), axis=1)
    out = np.empty(n)
    for i in range(n):
        picked = [runs[j] for j in (rng.integers(0, k, size=k) if k > 1 else [0])]
        pooled = np.concatenate([r[rng.integers(0, r.size, size=r.size)] for r in picked])
        out[i] = _stat(pooled, stat)
    return out


def bootstrap_delta(a, b, stat: str, n: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(point, low, high) of the relative change (B - A) / A of ``stat``, in percent.

    ``a``/``b``: the per-request samples of one run, or a list of runs. Percentile bootstrap; with several
    runs per side it is hierarchical (runs, then requests), so the interval also covers run-to-run drift.
    """
    ra, rb = _runs(a), _runs(b)
    base = _stat(np.concatenate(ra), stat)
    point = 100.0 * (_stat(np.concatenate(rb), stat) - base) / base if base else float("nan")
    rng = np.random.default_rng(seed)
    sa, sb = _resample(ra, rng, n, stat), _resample(rb, rng, n, stat)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = 100.0 * (sb - sa) / sa
    rel = rel[np.isfinite(rel)]
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = (
        (float(np.percentile(rel, tail)), float(np.percentile(rel, 100.0 - tail))) if rel.size else (np.nan,) * 2
    )
    return point, low, high


def _run_level_ci(va: list[float], vb: list[float], seed: int, n: int = 2000) -> Optional[list[float]]:
    """Bootstrap over runs of the change of a run-level mean; None with fewer than 3 runs on a side (two runs
    give only three distinct resampled means: no interval worth the name)."""
    if len(va) < 3 or len(vb) < 3:
        return None
    rng = np.random.default_rng(seed)
    x, y = np.asarray(va), np.asarray(vb)
    ma = x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1)
    mb = y[rng.integers(0, y.size, size=(n, y.size))].mean(axis=1)
    rel = 100.0 * (mb - ma) / ma
    return [float(np.percentile(rel, 2.5)), float(np.percentile(rel, 97.5))]


def compare(a, b, gates: Sequence[Gate] = (), seed: int = 0) -> dict:
    """Every metric both sides have: A, B, change %, its interval; then each gate's verdict.

    ``a``/``b``: one result document, or a list of results of the same build and workload (repeated runs).
    """
    a_docs = a if isinstance(a, list) else [a]
    b_docs = b if isinstance(b, list) else [b]
    rows = []
    wanted = {(g.metric, g.stat) for g in gates}
    for name in METRICS:
        if name in RUN_LEVEL:
            va = [d["metrics"].get(name, {}).get("value") for d in a_docs]
            vb = [d["metrics"].get(name, {}).get("value") for d in b_docs]
            if any(v is None for v in va + vb):
                continue
            ma, mb = float(np.mean(va)), float(np.mean(vb))
            rows.append(
                {
                    "metric": name,
                    "stat": "value",
                    "a": ma,
                    "b": mb,
                    "change_pct": 100.0 * (mb - ma) / ma if ma else None,
                    "ci_pct": _run_level_ci(va, vb, seed),
                }
            )
            continue
        sa = [d.get("samples", {}).get(name) for d in a_docs]
        sb = [d.get("samples", {}).get(name) for d in b_docs]
        if not all(sa) or not all(sb):
            continue
        stats = list(STATS) + sorted({s for m, s in wanted if m == name and s not in STATS})
        for stat in stats:
            point, low, high = bootstrap_delta(sa, sb, stat, seed=seed)
            rows.append(
                {
                    "metric": name,
                    "stat": stat,
                    "a": _stat(np.concatenate(_runs(sa)), stat),
                    "b": _stat(np.concatenate(_runs(sb)), stat),
                    "change_pct": point,
                    "ci_pct": [low, high],
                }
            )
    verdicts = []
    for g in gates:
        r = next((r for r in rows if r["metric"] == g.metric and r["stat"] == g.stat), None)
        if r is None or r["change_pct"] is None:
            raise BenchError(f"--fail-if {g.text!r}: {g.metric}.{g.stat} is not in both results")
        ch, ci = r["change_pct"], r["ci_pct"]
        if g.op == ">":
            crossed = ch > g.pct and (ci is None or ci[0] > 0)
        else:
            crossed = ch < g.pct and (ci is None or ci[1] < 0)
        why = f"change {ch:+.1f}%" + (f" (95% CI {ci[0]:+.1f}% .. {ci[1]:+.1f}%)" if ci else " (one value per run)")
        verdicts.append({"gate": g.text, "failed": crossed, "detail": why})
    return {
        "rows": rows,
        "gates": verdicts,
        "failed": any(v["failed"] for v in verdicts),
        "a": _ident(a_docs),
        "b": _ident(b_docs),
    }


def _ident(docs: list[dict]) -> dict:
    prov = docs[0].get("provenance") or {}
    return {
        "label": docs[0].get("label"),
        "created": ", ".join(str(d.get("created")) for d in docs),
        "recipe": (prov.get("recipe") or {}).get("name"),
        "runs": len(docs),
        "engine_config_sha256": (prov.get("repo") or {}).get("engine_config_sha256"),
        "requests": sum(d.get("run", {}).get("ok", 0) for d in docs),
    }


def render(result: dict) -> str:
    a, b = result["a"], result["b"]
    lines = [
        f"A: {a['recipe'] or '-'} {a['label']}, {a['runs']} run(s), {a['requests']} requests ({a['created']})",
        f"B: {b['recipe'] or '-'} {b['label']}, {b['runs']} run(s), {b['requests']} requests ({b['created']})",
        f"{'metric':<26}{'A':>12}{'B':>12}{'change':>10}   95% CI (bootstrap)",
    ]
    for r in result["rows"]:
        ci = f"{r['ci_pct'][0]:+7.1f}% .. {r['ci_pct'][1]:+7.1f}%" if r["ci_pct"] else "(one value per side)"
        ch = f"{r['change_pct']:+.1f}%" if r["change_pct"] is not None else "-"
        name = r["metric"] if r["stat"] == "value" else f"{r['metric']}.{r['stat']}"
        lines.append(f"{name:<26}{r['a']:>12.3f}{r['b']:>12.3f}{ch:>10}   {ci}")
    for v in result["gates"]:
        lines.append(f"{'FAIL' if v['failed'] else 'pass'} {v['gate']}: {v['detail']}")
    return "\n".join(lines)


def check_comparable(a: dict, b: dict) -> Optional[str]:
    """A warning when the two runs used different workloads (the deltas then mix workload and build)."""
    a, b = (a[0] if isinstance(a, list) else a), (b[0] if isinstance(b, list) else b)
    la, lb = a.get("load", {}), b.get("load", {})
    diff = [k for k in ("concurrency", "request_rate", "arrival", "isl", "osl") if la.get(k) != lb.get(k)]
    return f"the runs differ in workload ({', '.join(diff)}): deltas mix workload and build" if diff else None


def compare_paths(a: str, b: str, fail_if: Sequence[str], seed: int = 0) -> tuple[dict, Optional[str]]:
    """``trtpipe bench compare A B``: each side a comma-separated list of results (files or directories);
    returns the comparison and a warning when the two sides were not measured alike."""
    gates = [parse_gate(g) for g in fail_if]
    da = [load_result(Path(p)) for p in a.split(",") if p]
    db = [load_result(Path(p)) for p in b.split(",") if p]
    return compare(da, db, gates, seed=seed), check_comparable(da, db)
