"""``trtpipe bench compare A.json B.json``: per-metric deltas with a bootstrap confidence interval, and a gate.

For per-request metrics (ttft, itl, e2e, ...) each run keeps its per-request samples, so the delta of any
statistic (avg, p50, p99, ...) gets a percentile-bootstrap interval: both sample sets are resampled with
replacement (seeded), the statistic recomputed, and the 2.5/97.5 percentiles of the relative change taken.
Run-level numbers (throughputs) have one value per run: their delta is shown without an interval.

``--fail-if 'ttft.p99>+10%'`` fails (exit 1) when B's change crosses the threshold **and** the interval lies
entirely on that side of zero, i.e. the change is both large and not explained by run-to-run noise. For
run-level metrics only the point change can be tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from trtpipe.bench.metrics import METRICS, BenchError

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
        raise BenchError(f"--fail-if: cannot read {text!r} (expected METRIC.STAT>+N% or METRIC<-N%, "
                         "e.g. ttft.p99>+10%)")
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


def bootstrap_delta(a: Sequence[float], b: Sequence[float], stat: str, n: int = 2000, seed: int = 0,
                    level: float = 0.95) -> tuple[float, float, float]:
    """(point, low, high) of the relative change (B - A) / A of ``stat``, in percent."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    base = _stat(x, stat)
    point = 100.0 * (_stat(y, stat) - base) / base if base else float("nan")
    rng = np.random.default_rng(seed)
    xs = x[rng.integers(0, x.size, size=(n, x.size))]
    ys = y[rng.integers(0, y.size, size=(n, y.size))]
    if stat == "avg":
        sa, sb = xs.mean(axis=1), ys.mean(axis=1)
    else:
        q = float(stat[1:])
        sa, sb = np.percentile(xs, q, axis=1), np.percentile(ys, q, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = 100.0 * (sb - sa) / sa
    rel = rel[np.isfinite(rel)]
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = (float(np.percentile(rel, tail)), float(np.percentile(rel, 100.0 - tail))) if rel.size else (np.nan,) * 2
    return point, low, high


def compare(a: dict, b: dict, gates: Sequence[Gate] = (), seed: int = 0) -> dict:
    """Every metric both runs have: A, B, change %, its interval; then each gate's verdict."""
    rows = []
    wanted = {(g.metric, g.stat) for g in gates}
    for name in METRICS:
        if name in RUN_LEVEL:
            va, vb = a["metrics"].get(name, {}).get("value"), b["metrics"].get(name, {}).get("value")
            if va is None or vb is None:
                continue
            rows.append({"metric": name, "stat": "value", "a": va, "b": vb,
                         "change_pct": 100.0 * (vb - va) / va if va else None, "ci_pct": None})
            continue
        sa, sb = a.get("samples", {}).get(name), b.get("samples", {}).get(name)
        if not sa or not sb:
            continue
        stats = list(STATS) + sorted({s for m, s in wanted if m == name and s not in STATS})
        for stat in stats:
            point, low, high = bootstrap_delta(sa, sb, stat, seed=seed)
            rows.append({"metric": name, "stat": stat, "a": _stat(np.asarray(sa), stat),
                         "b": _stat(np.asarray(sb), stat), "change_pct": point, "ci_pct": [low, high]})
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
    return {"rows": rows, "gates": verdicts, "failed": any(v["failed"] for v in verdicts),
            "a": _ident(a), "b": _ident(b)}


def _ident(doc: dict) -> dict:
    prov = doc.get("provenance") or {}
    return {"label": doc.get("label"), "created": doc.get("created"),
            "recipe": (prov.get("recipe") or {}).get("name"),
            "engine_config_sha256": (prov.get("repo") or {}).get("engine_config_sha256"),
            "requests": doc.get("run", {}).get("ok")}


def render(result: dict) -> str:
    a, b = result["a"], result["b"]
    lines = [f"A: {a['recipe'] or '-'} {a['label']} {a['created']} ({a['requests']} requests)",
             f"B: {b['recipe'] or '-'} {b['label']} {b['created']} ({b['requests']} requests)",
             f"{'metric':<26}{'A':>12}{'B':>12}{'change':>10}   95% CI (bootstrap)"]
    for r in result["rows"]:
        ci = f"{r['ci_pct'][0]:+7.1f}% .. {r['ci_pct'][1]:+7.1f}%" if r["ci_pct"] else "(one value per run)"
        ch = f"{r['change_pct']:+.1f}%" if r["change_pct"] is not None else "-"
        name = r["metric"] if r["stat"] == "value" else f"{r['metric']}.{r['stat']}"
        lines.append(f"{name:<26}{r['a']:>12.3f}{r['b']:>12.3f}{ch:>10}   {ci}")
    for v in result["gates"]:
        lines.append(f"{'FAIL' if v['failed'] else 'pass'} {v['gate']}: {v['detail']}")
    return "\n".join(lines)


def check_comparable(a: dict, b: dict) -> Optional[str]:
    """A warning when the two runs used different workloads (the deltas then mix workload and build)."""
    la, lb = a.get("load", {}), b.get("load", {})
    diff = [k for k in ("concurrency", "request_rate", "arrival", "isl", "osl") if la.get(k) != lb.get(k)]
    return f"the runs differ in workload ({', '.join(diff)}): deltas mix workload and build" if diff else None
