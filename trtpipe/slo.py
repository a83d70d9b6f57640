"""One latency-SLO syntax, read by ``trtpipe bench --slo`` and ``trtpipe plan --slo``.

A comma-separated list of ``TERM SEP VALUE[UNIT]``:

- ``TERM`` is ``METRIC`` (every request within the bound) or ``METRIC_pQ`` (the run's Q-th percentile within it);
- ``SEP`` is ``:`` or ``=`` (both spellings were in use; they mean the same);
- ``UNIT`` is ``ms`` (the default), ``s`` or ``us``.

Examples: ``ttft:200ms,itl:50ms`` and ``ttft_p99=500ms,itl_p99=50ms``. Which terms a command accepts is its
own business: goodput (bench) counts requests, so it takes per-request bounds only; the capacity planner takes
both (a per-request bound is the run's maximum, p100). The result maps each term to milliseconds, in order.
It lives beside ``errors.py`` because bench and perf both read it and neither depends on the other.
"""

from __future__ import annotations

import re

from trtpipe.errors import TrtpipeError

UNITS_MS = {"ms": 1.0, "s": 1000.0, "us": 1e-3}
_TERM = re.compile(r"([a-z][a-z0-9]*)(?:_p(\d+(?:\.\d+)?))?\s*[:=]\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?")


def split_term(term: str) -> tuple[str, float | None]:
    """``"ttft_p99"`` -> ``("ttft", 99.0)``; ``"ttft"`` -> ``("ttft", None)`` (a bound on every request)."""
    metric, _, q = term.partition("_p")
    return metric, float(q) if q else None


def parse_slo(text: str | None, metrics: tuple[str, ...], percentiles: bool = True) -> dict[str, float]:
    """``"ttft:200ms,itl_p99=50ms"`` -> ``{"ttft": 200.0, "itl_p99": 50.0}`` (milliseconds).

    ``metrics`` are the names the caller can measure; ``percentiles=False`` refuses ``METRIC_pQ`` terms.
    A term that does not read is a one-line TrtpipeError naming it and showing the syntax."""
    out: dict[str, float] = {}
    example = "e.g. ttft:200ms,itl:50ms" + (" or ttft_p99=500ms" if percentiles else "")
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = _TERM.fullmatch(part)
        if not m or m.group(1) not in metrics:
            raise TrtpipeError(
                f"--slo: cannot read {part!r} (expected METRIC[_pQ]:VALUE[ms|s|us], {example}; "
                f"metrics: {', '.join(metrics)})"
            )
        if m.group(2) is not None and not percentiles:
            raise TrtpipeError(
                f"--slo: {part!r} is a percentile target; this command bounds each request "
                f"(write {m.group(1)}:{m.group(3)}{m.group(4) or 'ms'})"
            )
        if m.group(2) is not None and not 0 < float(m.group(2)) <= 100:
            raise TrtpipeError(f"--slo: {part!r}: the percentile must be in (0, 100]")
        key = m.group(1) if m.group(2) is None else f"{m.group(1)}_p{m.group(2)}"
        out[key] = float(m.group(3)) * UNITS_MS[m.group(4) or "ms"]
    if not out:
        raise TrtpipeError(f"--slo: empty ({example})")
    return out
