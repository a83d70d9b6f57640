"""Every metric ``trtpipe bench`` reports, each with its formula, computed from per-request timestamps.

Tools disagree on names (vLLM's "ITL" is a pooled list of chunk gaps, GuideLLM's "TPOT" includes the first
token), so each metric here carries the formula it was computed with, and the JSON repeats it. Percentiles
are numpy's linear interpolation, the method AIPerf and genai-perf use, so numbers can be set side by side.

A request record (:class:`Request`) holds times in nanoseconds on one clock: when the request was sent
and when each non-empty response arrived, plus its token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from trtpipe import slo as slo_syntax
from trtpipe.errors import TrtpipeError

PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
NS_PER_MS = 1e6
NS_PER_S = 1e9


class BenchError(TrtpipeError):
    """A benchmark that cannot run or cannot be read (names the file, option or metric)."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    formula: str
    per_request: bool = True  # False: one number per run (throughputs)


# One table: name -> unit and formula. Keys are what --slo, --fail-if and the JSON use.
METRICS = {
    m.name: m
    for m in (
        Metric("ttft", "ms", "first non-empty response time - request send time (client clock)"),
        Metric("ttst", "ms", "second non-empty response time - first non-empty response time"),
        Metric("itl", "ms", "(e2e - ttft) / (osl - 1), one value per request with osl > 1 (AIPerf/genai-perf 'ITL')"),
        Metric("tpot", "ms", "(e2e - ttft) / (osl - 1): the same number as itl; vLLM and trtllm-bench call it TPOT"),
        Metric(
            "chunk_gap",
            "ms",
            "time between consecutive non-empty responses, pooled over all requests "
            "(vLLM's 'ITL'; one response may carry several tokens)",
        ),
        Metric("e2e", "ms", "last response time - request send time"),
        Metric("decode", "ms", "e2e - ttft (time spent after the first token)"),
        Metric("osl", "tokens", "output tokens of the request (count source in token_counts)"),
        Metric("isl", "tokens", "prompt tokens of the request (client tokenizer, no special tokens)"),
        Metric("user_tps", "tokens/s", "1000 / itl: output speed one user sees after the first token"),
        Metric(
            "request_throughput",
            "requests/s",
            "successful requests / duration; duration = last response time - first request send time",
            per_request=False,
        ),
        Metric(
            "output_token_throughput", "tokens/s", "sum of osl over successful requests / duration", per_request=False
        ),
        Metric("total_token_throughput", "tokens/s", "sum of (isl + osl) / duration", per_request=False),
        Metric(
            "goodput",
            "requests/s",
            "requests meeting every --slo bound / duration (DistServe definition)",
            per_request=False,
        ),
        Metric(
            "good_request_fraction",
            "ratio",
            "requests meeting every --slo bound / (successful + failed requests)",
            per_request=False,
        ),
    )
}


@dataclass
class Request:
    """One request as the client saw it (times: ns, one clock)."""

    start_ns: int
    responses_ns: list[int]  # non-empty responses, in order
    osl: Optional[int] = None
    isl: Optional[int] = None
    error: Optional[str] = None
    server: dict = field(default_factory=dict)  # per-request server fields (perf metrics, token counts)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.responses_ns)


def request_values(r: Request) -> dict[str, Optional[float]]:
    """Per-request metric values in their units (None where the formula does not apply)."""
    if not r.ok:
        return {}
    t = r.responses_ns
    ttft = (t[0] - r.start_ns) / NS_PER_MS
    e2e = (t[-1] - r.start_ns) / NS_PER_MS
    itl = (e2e - ttft) / (r.osl - 1) if r.osl and r.osl > 1 else None
    return {
        "ttft": ttft,
        "ttst": (t[1] - t[0]) / NS_PER_MS if len(t) > 1 else None,
        "itl": itl,
        "tpot": itl,
        "e2e": e2e,
        "decode": e2e - ttft,
        "osl": float(r.osl) if r.osl is not None else None,
        "isl": float(r.isl) if r.isl is not None else None,
        "user_tps": 1000.0 / itl if itl else None,
    }


def stats(values: Sequence[float]) -> Optional[dict]:
    """avg, min, max, std and p1..p99 (numpy linear interpolation); None for no values."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return None
    out = {
        "avg": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "std": float(a.std()),
        "n": int(a.size),
    }
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


# --- SLOs and goodput ------------------------------------------------------------------------------

SLO_METRICS = ("ttft", "ttst", "itl", "tpot", "e2e")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft:200ms,itl:50ms`` -> {"ttft": 200.0, "itl": 50.0} (milliseconds): per-request bounds in the one
    SLO syntax of :mod:`trtpipe.slo` (goodput counts requests, so percentile terms are refused)."""
    return slo_syntax.parse_slo(text, SLO_METRICS, percentiles=False)


def meets(values: dict, slo: dict[str, float]) -> bool:
    """True when every SLO metric of the request is within its bound (a missing value fails itl/ttst only
    when the request had a single token: such a request has no inter-token time, so it passes)."""
    for key, bound in slo.items():
        v = values.get(key)
        if v is not None and v > bound:
            return False
    return True


# --- the whole run ---------------------------------------------------------------------------------


def summarize(requests: Sequence[Request], slo: Optional[dict[str, float]] = None) -> dict:
    """Every metric of one run: per-request distributions and run-level throughputs, with formulas."""
    ok = [r for r in requests if r.ok]
    failed = len(requests) - len(ok)
    if not ok:
        raise BenchError(f"no request succeeded ({failed} failed)")
    per = [request_values(r) for r in ok]
    start = min(r.start_ns for r in ok)
    end = max(r.responses_ns[-1] for r in ok)
    duration_s = (end - start) / NS_PER_S
    out: dict[str, dict] = {}
    for name, m in METRICS.items():
        if not m.per_request:
            continue
        if name == "chunk_gap":
            gaps = [(b - a) / NS_PER_MS for r in ok for a, b in zip(r.responses_ns, r.responses_ns[1:])]
            s = stats(gaps)
        else:
            s = stats([v.get(name) for v in per])
        if s is not None:
            out[name] = {"unit": m.unit, "formula": m.formula, **s}
    osl = sum(r.osl or 0 for r in ok)
    isl = sum(r.isl or 0 for r in ok)

    def run_level(name: str, value: float) -> None:
        m = METRICS[name]
        out[name] = {"unit": m.unit, "formula": m.formula, "value": value}

    run_level("request_throughput", len(ok) / duration_s if duration_s > 0 else float("nan"))
    run_level("output_token_throughput", osl / duration_s if duration_s > 0 else float("nan"))
    run_level("total_token_throughput", (osl + isl) / duration_s if duration_s > 0 else float("nan"))
    if slo:
        good = sum(1 for v in per if meets(v, slo))
        run_level("goodput", good / duration_s if duration_s > 0 else float("nan"))
        run_level("good_request_fraction", good / len(requests))
        out["goodput"]["slo_ms"] = dict(slo)
        out["good_request_fraction"]["slo_ms"] = dict(slo)
    out["_run"] = {"requests": len(requests), "ok": len(ok), "failed": failed, "duration_s": duration_s}
    return out


def samples(requests: Sequence[Request]) -> dict[str, list[float]]:
    """Per-request values of every per-request metric (kept in the run JSON for compare's statistics)."""
    per = [request_values(r) for r in requests if r.ok]
    out = {}
    for name, m in METRICS.items():
        if m.per_request and name not in ("chunk_gap", "tpot"):
            vals = [round(v[name], 4) for v in per if v.get(name) is not None]
            if vals:
                out[name] = vals
    for name in SERVER_METRICS:  # the server split, where the server returned perf metrics
        vals = [round(r.server[name], 4) for r in requests if r.ok and r.server.get(name) is not None]
        if vals:
            out[name] = vals
    return out


# --- server-side per-request timing (return_perf_metrics) --------------------------------------------

PERF_FIELDS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
SERVER_METRICS = {
    "server_queue": "first_scheduled_time_ns - arrival_time_ns (waiting in the executor before the first step)",
    "server_prefill": "first_token_time_ns - first_scheduled_time_ns (context phase until the first token)",
    "server_decode": "last_token_time_ns - first_token_time_ns",
    "outside_executor": "client ttft - (first_token_time_ns - arrival_time_ns): transport, front end, "
    "pre/postprocessing and delivery of the first token",
}


def server_split(responses: Sequence[dict], client_ttft_ms: Optional[float]) -> dict:
    """Per-request server timing from the ``return_perf_metrics`` outputs of a request's responses.

    The backend stamps these on its own steady clock, so only differences between them are used (never a
    join of server and client absolute times); ``outside_executor`` subtracts the server's part of TTFT
    from the client's TTFT. ``num_output_tokens`` of every response is summed (they count per response).
    """
    fields: dict = {}
    tokens = 0
    seen_tokens = False
    for r in responses:
        for k in PERF_FIELDS:
            if r.get(k) is not None:
                fields[k] = int(r[k])  # the last response carries the final values
        if r.get("num_output_tokens") is not None:
            tokens += int(r["num_output_tokens"])
            seen_tokens = True
    out: dict = {}
    if seen_tokens:
        out["num_output_tokens"] = tokens
    if all(k in fields for k in PERF_FIELDS):
        a, s, f, last = (fields[k] for k in PERF_FIELDS)
        out["server_queue"] = (s - a) / NS_PER_MS
        out["server_prefill"] = (f - s) / NS_PER_MS
        out["server_decode"] = (last - f) / NS_PER_MS
        if client_ttft_ms is not None:
            out["outside_executor"] = client_ttft_ms - (f - a) / NS_PER_MS
    return out


def server_split_summary(requests: Sequence[Request]) -> dict:
    """Distributions of the server split over the requests that carried it (empty when none did)."""
    out = {}
    for name, formula in SERVER_METRICS.items():
        s = stats([r.server.get(name) for r in requests if r.ok])
        if s is not None:
            out[name] = {"unit": "ms", "formula": formula, **s}
    return out
