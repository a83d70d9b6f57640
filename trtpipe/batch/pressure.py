"""How hard a batch job may push the server: an in-flight window that backs off under pressure.

A batch job is background work, so it yields to everything else. The window is additive-increase /
multiplicative-decrease, as TCP's congestion window: each success widens it by ``1/window`` (one request per
window's worth of successes), each pressure signal halves it (never below 1), and a pause holds back every new
send until a deadline. Pressure signals are the server's own words:

  * 429 or 503, with ``Retry-After`` (seconds or an HTTP date, RFC 9110 section 10.2.3) when the server sends
    one: halve, and pause until then; without it, pause for an exponential backoff.
  * Its Prometheus metrics (``trtllm_kv_cache_utilization``, ``trtllm_num_requests_waiting``, as trtllm-serve's
    ``/prometheus/metrics`` names them): the KV pool nearly full, or more requests waiting than this job has in
    flight (so someone else's are waiting behind ours).

Many requests of one window come back 429 together; only the first halves it (each send carries the window's
``epoch``, and a signal about a send older than the last decrease is already accounted for), so one burst of
refusals costs one halving, not ten. Everything here is plain arithmetic on the caller's clock.
"""

from __future__ import annotations

import email.utils
import math
from dataclasses import dataclass
from typing import Optional

from trtpipe.bench.server_view import parse as parse_prometheus

RETRYABLE_STATUS = frozenset({429, 503, 502, 504, 500, 408})  # worth sending again; the rest is the request's
OVERLOAD_STATUS = frozenset({429, 503})  # the server says it is too busy: back off, and the try does not count
MAX_RETRY_AFTER_S = 120.0
KV_HIGH = 0.95


def parse_retry_after(value: Optional[str], now_unix: float) -> Optional[float]:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or HTTP-date), capped; None when absent or
    unreadable (the caller backs off on its own then)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now_unix
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def backoff_s(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff before try ``attempt`` (1, 2, ...) of one request, capped."""
    return min(cap, base * 2 ** max(attempt - 1, 0))


@dataclass
class ServerLoad:
    """The two gauges of the server's Prometheus text that say it is under pressure (None: not exported)."""

    waiting: Optional[float]
    kv_utilization: Optional[float]


def server_load(prometheus_text: str) -> ServerLoad:
    samples = parse_prometheus(prometheus_text)

    def total(name: str) -> Optional[float]:
        values = [v for (n, _), v in samples.items() if n == name]
        return sum(values) if values else None

    return ServerLoad(total("trtllm_num_requests_waiting"), total("trtllm_kv_cache_utilization"))


def under_pressure(load: ServerLoad, ours_in_flight: int, kv_high: float = KV_HIGH) -> bool:
    """The KV pool nearly full, or requests waiting beyond all of ours (others queue behind the batch)."""
    if load.kv_utilization is not None and load.kv_utilization >= kv_high:
        return True
    return load.waiting is not None and load.waiting > ours_in_flight


class Window:
    """The in-flight limit (AIMD) and the pause deadline; see the module docstring."""

    def __init__(self, limit: int):
        self.max = max(1, int(limit))
        self.size = float(self.max)
        self.epoch = 0
        self.paused_until = 0.0  # the caller's clock
        self.decreases = 0

    @property
    def allowed(self) -> int:
        return max(1, int(self.size))

    def on_success(self) -> None:
        self.size = min(float(self.max), self.size + 1.0 / self.size)

    def on_pressure(self, epoch: int) -> bool:
        """Halve, once per epoch (a send of an older epoch is already accounted for); True when it halved."""
        if epoch < self.epoch:
            return False
        self.size = max(1.0, self.size / 2)
        self.epoch += 1
        self.decreases += 1
        return True

    def pause(self, until: float) -> None:
        self.paused_until = max(self.paused_until, until)
