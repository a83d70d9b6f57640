"""The server's side of a benchmark: tritonserver's Prometheus metrics scraped before, during and after a run.

Counters (``nv_inference_*``) are cumulative, so a run's numbers are differences between the scrape before
and the scrape after (mean queue time = Δqueue_duration_us / Δrequest_success). Gauges (pending requests and
the TensorRT-LLM backend's ``nv_trt_llm_*`` families: active/scheduled/waiting requests, KV blocks) only mean
something while the load runs, so a thread samples them during the run. Every family is optional: a server
without the in-flight batching executor simply has no ``nv_trt_llm_*`` series, and the view says so.

From these, :func:`limiter` names what limits a sweep point: KV blocks full, batch slots full, requests
waiting inside the executor, or requests queueing in Triton's scheduler in front of a model (which model).
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Optional

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Counters whose per-model difference over the run is reported (Triton core, docs/user_guide/metrics.md).
COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)
# Gauges sampled during the run: Triton's queue, and the TensorRT-LLM backend's families (label -> values).
GAUGES = {
    "nv_inference_pending_request_count": None,
    "nv_trt_llm_request_metrics": "request_type",
    "nv_trt_llm_kv_cache_block_metrics": "kv_cache_block_type",
    "nv_trt_llm_inflight_batcher_metrics": "inflight_batcher_specific_metric",
}
# Histograms of token counts per finished request (TensorRT-LLM backend) and Triton's server-side TTFT.
HISTOGRAMS = ("nv_llm_input_token_len", "nv_llm_output_token_len", "nv_inference_first_response_histogram_ms")


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {(metric name, sorted labels): value}."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(3) or "")))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            continue
    return out


def scrape(url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse(r.read().decode("utf-8", "replace"))


def _label(labels: Labels, key: str) -> Optional[str]:
    return dict(labels).get(key)


def counter_deltas(before: Samples, after: Samples) -> dict[str, dict[str, float]]:
    """model -> {counter (failures as ``nv_inference_request_failure:REASON``): after - before}."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, labels), value in after.items():
        if name not in COUNTERS:
            continue
        model = _label(labels, "model") or "?"
        key = name if name != "nv_inference_request_failure" else f"{name}:{_label(labels, 'reason') or 'OTHER'}"
        delta = value - before.get((name, labels), 0.0)
        out[model][key] = out[model].get(key, 0.0) + delta
    return dict(out)


def model_breakdown(deltas: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per model: requests, failures, mean queue / compute / request ms, average executed batch size."""
    out = {}
    for model, d in sorted(deltas.items()):
        ok = d.get("nv_inference_request_success", 0.0)
        failed = sum(v for k, v in d.items() if k.startswith("nv_inference_request_failure:"))
        if ok + failed <= 0:
            continue
        n = max(ok + failed, 1.0)

        def ms(key: str) -> float:
            return d.get(key, 0.0) / n / 1000.0

        execs = d.get("nv_inference_exec_count", 0.0)
        out[model] = {
            "requests": int(ok),
            "failures": int(failed),
            "request_ms": ms("nv_inference_request_duration_us"),
            "queue_ms": ms("nv_inference_queue_duration_us"),
            "compute_input_ms": ms("nv_inference_compute_input_duration_us"),
            "compute_infer_ms": ms("nv_inference_compute_infer_duration_us"),
            "compute_output_ms": ms("nv_inference_compute_output_duration_us"),
            "avg_batch": d.get("nv_inference_count", 0.0) / execs if execs else None,
        }
    return out


def histogram_deltas(before: Samples, after: Samples) -> dict[str, dict[str, float]]:
    """Histogram family -> {"sum", "count"} differences (only the families present on the server)."""
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in after.items():
        for fam in HISTOGRAMS:
            for part in ("sum", "count"):
                if name == f"{fam}_{part}":
                    d = out.setdefault(fam, {"sum": 0.0, "count": 0.0})
                    d[part] += value - before.get((name, labels), 0.0)
    return out


def gauge_values(samples: Samples) -> dict[str, float]:
    """The sampled gauges flattened: ``pending:<model>``, ``<family>:<category value>`` (summed over models)."""
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name not in GAUGES:
            continue
        key_label = GAUGES[name]
        if key_label is None:
            key = f"pending:{_label(labels, 'model') or '?'}"
        else:
            key = f"{name}:{_label(labels, key_label) or '?'}"
        out[key] = out.get(key, 0.0) + value
    return out


class Sampler:
    """A thread that scrapes ``url`` every ``interval`` seconds and keeps the gauges (for the run's duration)."""

    def __init__(self, url: str, interval: float = 0.25):
        self.url, self.interval = url, interval
        self.series: list[tuple[int, dict[str, float]]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.series.append((time.time_ns(), gauge_values(scrape(self.url, timeout=2.0))))
            except (urllib.error.URLError, OSError, ValueError):
                self.errors += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def gauge_summary(series: list[tuple[int, dict[str, float]]], start_ns: int, end_ns: int) -> dict[str, dict]:
    """mean and max of every gauge over the samples taken while the run's load was on."""
    window = [g for t, g in series if start_ns <= t <= end_ns] or [g for _, g in series]
    keys = sorted({k for g in window for k in g})
    out = {}
    for k in keys:
        vals = [g.get(k, 0.0) for g in window]
        out[k] = {"mean": sum(vals) / len(vals), "max": max(vals), "samples": len(vals)}
    return out


def limiter(view: dict) -> dict:
    """What the server says limits this load point, most specific first.

    KV blocks full (``fraction`` near 1), batch slots full (``scheduled`` at ``max``), requests waiting inside
    the executor (``waiting`` > 0), requests queueing in Triton in front of a model (the model with the largest
    share of its request time spent in the queue), else nothing on the server (latency is compute/transport).
    """
    g = view.get("gauges", {})

    def mean(key: str) -> Optional[float]:
        return g[key]["mean"] if key in g else None

    kv = mean("nv_trt_llm_kv_cache_block_metrics:fraction")
    scheduled, cap = mean("nv_trt_llm_request_metrics:scheduled"), mean("nv_trt_llm_request_metrics:max")
    waiting = mean("nv_trt_llm_request_metrics:waiting")
    if kv is not None and kv >= 0.9:
        return {"limiter": "kv_blocks_full", "evidence": f"KV blocks used fraction averages {kv:.2f}"}
    if scheduled is not None and cap and scheduled / cap >= 0.9:
        return {
            "limiter": "batch_slots_full",
            "evidence": f"scheduled requests average {scheduled:.1f} of max {cap:.0f}",
        }
    if waiting is not None and waiting >= 0.5:
        return {"limiter": "executor_waiting", "evidence": f"{waiting:.1f} active requests not scheduled on average"}
    models = view.get("models", {})
    # the model whose requests wait longest in Triton's queue; it limits the point when that wait is a real
    # part of what the client sees (>= 10% of the client's mean E2E, else >= 20% of the model's own time)
    worst = max(models, key=lambda n: models[n]["queue_ms"], default=None)
    client = view.get("client_e2e_ms")
    share = models[worst]["queue_ms"] / models[worst]["request_ms"] if worst and models[worst]["request_ms"] else 0.0
    big = (
        worst is not None
        and models[worst]["queue_ms"] >= 1.0
        and (models[worst]["queue_ms"] >= 0.1 * client if client else share >= 0.2)
    )
    if big:
        m = models[worst]
        pending = mean(f"pending:{worst}")
        more = f", {pending:.1f} pending on average" if pending is not None else ""
        return {
            "limiter": "queueing",
            "model": worst,
            "evidence": f"{worst}: {share:.0%} of its request time in Triton's queue "
            f"(queue {m['queue_ms']:.1f} ms of {m['request_ms']:.1f} ms{more})",
        }
    if not models:
        return {"limiter": "unknown", "evidence": "no server metrics"}
    return {"limiter": "none", "evidence": "no queue, batch or KV limit reached on the server"}


def server_view(
    before: Samples,
    after: Samples,
    series: list,
    start_ns: int,
    end_ns: int,
    sampler_errors: int = 0,
    client_e2e_ms: Optional[float] = None,
) -> dict:
    """The run's server view: per-model counter breakdown, token histograms, gauge summary, limiter."""
    view = {
        "models": model_breakdown(counter_deltas(before, after)),
        "histograms": histogram_deltas(before, after),
        "gauges": gauge_summary(series, start_ns, end_ns),
        "trt_llm_metrics": any(name.startswith("nv_trt_llm_") for name, _ in after),
        "samples": len(series),
        "sampler_errors": sampler_errors,
        "client_e2e_ms": client_e2e_ms,
    }
    view.update(limiter(view))
    return view


def server_tokens(view: dict) -> Optional[float]:
    """Output tokens the server counted over the run (Δ nv_llm_output_token_len_sum), when it exports them."""
    h = view.get("histograms", {}).get("nv_llm_output_token_len")
    return h["sum"] if h and not math.isnan(h["sum"]) else None
