"""Prometheus text-format histograms for the OpenAI twin's ``/prometheus/metrics``, with trtllm-serve's buckets.

The twin writes the exposition text itself (no prometheus_client registry: one server per process is not
guaranteed in tests). Buckets are upstream's defaults (NVIDIA/TensorRT-LLM@050f80de
``tensorrt_llm/metrics/collector.py`` ``MetricsCollector.__init__``), so one histogram_quantile rule reads the
twin and trtllm-serve alike.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

_LONG = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
BUCKETS = {
    "trtllm_e2e_request_latency_seconds": _LONG,
    "trtllm_time_to_first_token_seconds": (
        0.001,
        0.005,
        0.01,
        0.02,
        0.04,
        0.06,
        0.08,
        0.1,
        0.25,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
        160.0,
        640.0,
        2560.0,
    ),
    "trtllm_time_per_output_token_seconds": (
        0.01,
        0.025,
        0.05,
        0.075,
        0.1,
        0.15,
        0.2,
        0.3,
        0.4,
        0.5,
        0.75,
        1.0,
        2.5,
        5.0,
        7.5,
        10.0,
        20.0,
        40.0,
        80.0,
    ),
    "trtllm_request_queue_time_seconds": _LONG,
}


@dataclass
class Histogram:
    """Cumulative bucket counts, sum and count of one unlabelled-by-value histogram."""

    name: str
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)  # le is inclusive: value == bound lands in that bucket
        if i < len(self.bounds):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, labels: str) -> list[str]:
        out, run = [f"# TYPE {self.name} histogram"], 0
        for bound, c in zip(self.bounds, self.counts):
            run += c
            out.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {run}')
        out += [
            f'{self.name}_bucket{{{labels},le="+Inf"}} {self.n}',
            f"{self.name}_sum{{{labels}}} {self.total}",
            f"{self.name}_count{{{labels}}} {self.n}",
        ]
        return out


def histograms() -> dict[str, Histogram]:
    """One empty histogram per name of :data:`BUCKETS`."""
    return {name: Histogram(name, bounds) for name, bounds in BUCKETS.items()}
