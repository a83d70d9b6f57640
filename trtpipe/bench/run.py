"""One benchmark point, end to end: scrape the server, run AIPerf, scrape again, join, write one JSON.

The result file (``format: trtpipe-bench/1``) holds the recipe's provenance, every metric with its formula
(computed by trtpipe from AIPerf's per-request records), AIPerf's own summary numbers for the same metrics
side by side (they must agree: same records, same percentile method), the server view (per-model queue and
compute time, TensorRT-LLM gauges, what limits the point), the token-count cross-check, and the per-request
samples ``bench compare`` needs for its confidence intervals.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from trtpipe.bench import aiperf
from trtpipe.bench.metrics import METRICS, BenchError, Request, samples, server_split_summary, summarize
from trtpipe.bench.server_view import Sampler, scrape, server_tokens, server_view
from trtpipe.bench.target import Target, provenance
from trtpipe.jsonfile import load_json

FORMAT = "trtpipe-bench/1"
RESULT_KEYS = ("metrics",)  # what show and compare read from every result (show also reads run, target)
# Client and server token counts disagree when they differ by more than this (AIPerf's OSL-mismatch rule:
# min(5% of OSL, 50 tokens)).
MISMATCH_PCT, MISMATCH_ABS = 5.0, 50


def agreement(ours: dict, theirs: dict) -> dict:
    """trtpipe's number vs AIPerf's for every metric both report: {metric: {stat: [ours, aiperf, rel_diff]}}."""
    out = {}
    for name, tag in aiperf.AIPERF_TAGS.items():
        a, b = ours.get(name), theirs.get(tag)
        if not a or not isinstance(b, dict):
            continue
        row = {}
        for stat in ("avg", "p50", "p90", "p99", "min", "max", "value"):
            if stat not in a:
                continue
            other = b.get("avg" if stat == "value" else stat)
            if other is None:
                continue
            rel = abs(a[stat] - other) / abs(other) if other else abs(a[stat])
            row[stat] = [a[stat], other, rel]
        if row:
            out[name] = row
    return out


def token_check(requests: list[Request], osl: int, fixed: Optional[str], server_total: Optional[float]) -> dict:
    """Client token counts (AIPerf re-tokenizes the returned text) against the server's, or against the
    requested length when the request forced it (``end_id=-1`` / ``min_tokens``)."""
    ok = [r for r in requests if r.ok and r.osl is not None]
    client_total = sum(r.osl for r in ok)
    limit = min(osl * MISMATCH_PCT / 100.0, MISMATCH_ABS)
    out = {
        "client_source": "AIPerf: the model's tokenizer on the returned text (add_special_tokens=False)",
        "client_total": client_total,
        "requested_osl": osl,
        "fixed_by": fixed,
        "server_total": server_total,
        "server_source": "delta of nv_llm_output_token_len_sum" if server_total is not None else None,
    }
    if server_total is not None:
        diff = client_total - server_total
        out["diff_pct"] = 100.0 * diff / server_total if server_total else None
        bad = abs(diff) > limit * max(len(ok), 1)
        reference = f"the server counted {server_total:.0f}"
    elif fixed:
        mism = [r.osl for r in ok if abs(r.osl - osl) > limit]
        out["mismatched_requests"] = len(mism)
        out["diff_pct"] = 100.0 * (client_total - osl * len(ok)) / (osl * len(ok)) if ok else None
        bad = bool(mism)
        reference = (
            f"every request generated exactly {osl} tokens ({fixed}), {len(mism)} requests re-tokenize differently"
        )
    else:
        out["warning"] = (
            "no server-side token count and no fixed output length: client counts cannot be "
            "checked (the model may stop at EOS before max_tokens)"
        )
        return out
    if bad:
        out["warning"] = (
            f"client and server token counts disagree: AIPerf counted {client_total} output tokens, "
            f"{reference}; throughput in tokens/s uses the client count"
        )
    return out


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


def run_point(
    target: Target,
    load: aiperf.Load,
    out_dir: Path,
    slo: Optional[dict] = None,
    recipe=None,
    binary: Optional[Path] = None,
    fixed_output: bool = True,
    sample_interval: float = 0.25,
) -> dict:
    """Benchmark one load point into ``out_dir`` (``result.json`` + AIPerf's files); return the result."""
    load.check()
    target.check_lengths(load.isl, load.osl, load.isl_stddev)
    binary = binary or aiperf.find_aiperf()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    before = scrape(target.metrics_url) if target.metrics_url else {}
    series: list = []
    sampler_errors = 0
    t0 = time.time_ns()
    if target.metrics_url:
        with Sampler(target.metrics_url, sample_interval) as sampler:
            ar = aiperf.run(binary, target, load, out_dir, slo)
        series, sampler_errors = sampler.series, sampler.errors
    else:
        ar = aiperf.run(binary, target, load, out_dir, slo)
    after = scrape(target.metrics_url) if target.metrics_url else {}
    reqs = ar.requests
    summary = summarize(reqs, slo)
    run_info = summary.pop("_run")
    ok = [r for r in reqs if r.ok]
    start = min(r.start_ns for r in ok)
    end = max(r.responses_ns[-1] for r in ok)
    view = (
        server_view(before, after, series, start, end, sampler_errors, summary["e2e"]["avg"])
        if target.metrics_url
        else None
    )
    fixed = None
    if fixed_output:
        body = target.body_template(True)
        fixed = "min_tokens=max_tokens" if "min_tokens" in body else "end_id=-1" if "end_id" in body else None
    per_request = [r.server["num_output_tokens"] for r in ok if "num_output_tokens" in r.server]
    server_total = (
        float(sum(per_request))
        if per_request and len(per_request) == len(ok)
        else (server_tokens(view) if view else None)
    )
    tokens = token_check(reqs, load.osl, fixed, server_total)
    if per_request and len(per_request) == len(ok):
        tokens["server_source"] = "num_output_tokens of every streamed response (return_num_output_tokens)"
    warnings = []
    if tokens.get("warning"):
        warnings.append(tokens["warning"])
    if run_info["failed"]:
        first = next(r.error for r in reqs if not r.ok)
        warnings.append(f"{run_info['failed']} of {run_info['requests']} requests failed; first: {first}")
    if not target.streaming:
        warnings.append(
            f"{target.model} is not decoupled (recipe triton.streaming: false): one response per "
            "request, so ttft = e2e and itl is not measured"
        )
    doc = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "label": load.label(),
        "target": target.to_json(),
        "load": asdict(load),
        "slo_ms": slo or None,
        "run": {**run_info, "wall_s": (time.time_ns() - t0) / 1e9},
        "metrics": summary,
        "formulas": {k: m.formula for k, m in METRICS.items()},
        "aiperf": {
            "command": ar.command,
            "export_dir": str(ar.out_dir),
            "version": ar.summary.get("aiperf_version"),
            "agreement": agreement(summary, ar.summary),
            "note": "AIPerf divides request and token throughput by its profiling phase window, which "
            "can be slightly longer than the first-send-to-last-response duration used here",
        },
        "server": view,
        "server_split": server_split_summary(reqs)
        or {
            "note": f"{target.model} returns no per-request perf metrics (return_perf_metrics is not one of its "
            "inputs): TTFT is not split into queue, prefill and delivery"
        },
        "token_counts": tokens,
        "warnings": warnings,
        "provenance": provenance(target, recipe, ar.summary.get("aiperf_version")),
        "samples": samples(reqs),
    }
    _write_json(out_dir / "result.json", doc)
    return doc


def load_result(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    try:
        doc = load_json(path, BenchError, finite=False)
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read a bench result ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
        raise BenchError(f"{path}: not a trtpipe bench result (format {found!r}, expected {FORMAT})")
    missing = [k for k in RESULT_KEYS if not isinstance(doc.get(k), dict)]
    if missing:
        raise BenchError(f"{path}: bench result without {', '.join(repr(k) for k in missing)} (truncated or edited?)")
    return doc


def render(doc: dict) -> str:
    """The console summary of one result."""
    m = doc["metrics"]
    lines = [
        f"{doc['label']}: {doc['run']['ok']}/{doc['run']['requests']} ok in {doc['run']['duration_s']:.2f} s, "
        f"model {doc['target']['model']} ({'streaming' if doc['target']['streaming'] else 'not streaming'})"
    ]
    for name in ("ttft", "ttst", "itl", "e2e", "osl"):
        if name in m:
            s = m[name]
            lines.append(
                f"  {name:<5} {s['unit']:<6} avg {s['avg']:9.2f}  p50 {s['p50']:9.2f}  p90 {s['p90']:9.2f}  "
                f"p99 {s['p99']:9.2f}  ({s['formula']})"
            )
    for name in ("request_throughput", "output_token_throughput", "goodput", "good_request_fraction"):
        if name in m:
            lines.append(f"  {name} {m[name]['value']:.3f} {m[name]['unit']}  ({m[name]['formula']})")
    split = doc.get("server_split") or {}
    for name in ("server_queue", "server_prefill", "server_decode", "outside_executor"):
        if name in split:
            s = split[name]
            lines.append(
                f"  {name:<16} ms avg {s['avg']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f}  ({s['formula']})"
            )
    view = doc.get("server")
    if view:
        lines.append(f"  server: limiter {view['limiter']} ({view['evidence']})")
        for model, b in view["models"].items():
            batch = f", avg batch {b['avg_batch']:.2f}" if b.get("avg_batch") else ""
            lines.append(
                f"    {model:<18} {b['requests']:>5} req  queue {b['queue_ms']:8.2f} ms  "
                f"infer {b['compute_infer_ms']:8.2f} ms  request {b['request_ms']:8.2f} ms{batch}"
            )
        if not view["trt_llm_metrics"]:
            lines.append("    (no nv_trt_llm_* metrics on this server: batch slots and KV blocks are not reported)")
    for w in doc.get("warnings", []):
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def agreement_table(doc: dict) -> str:
    """trtpipe's numbers next to AIPerf's own export of the same run (the 'same tool' check)."""
    lines = [f"{'metric':<26}{'stat':<7}{'trtpipe':>14}{'AIPerf':>14}{'rel diff':>11}"]
    worst = 0.0
    for name, row in doc["aiperf"]["agreement"].items():
        for stat, (ours, theirs, rel) in row.items():
            lines.append(f"{name:<26}{stat:<7}{ours:>14.4f}{theirs:>14.4f}{rel:>11.2e}")
            if name not in ("request_throughput", "output_token_throughput", "goodput"):
                worst = max(worst, rel)
    lines.append(
        f"largest relative difference on per-request metrics: {worst:.1e} "
        f"(AIPerf export: {doc['aiperf']['export_dir']})"
    )
    lines.append(f"note: {doc['aiperf']['note']}")
    return "\n".join(lines)
