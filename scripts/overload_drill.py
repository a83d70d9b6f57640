"""Overload drill for the OpenAI twin: measure the server's capacity, then offer 4x that for N seconds.

What it shows (printed as one JSON summary): every request refused under overload gets 429 (or 503) with
``Retry-After`` and how fast the refusal came (time-to-reject p50/p99/max); the accepted ones complete (200 with
text); lower priorities are refused first (accept rate per priority); the server's RSS before, at its peak and after
(memory stays bounded by the queue limit); and afterwards ``/health`` is 200 and a greedy request answers what it
answered before the drill. The server is a real child process (``trtpipe serve --detach``'s path), on 127.0.0.1::

    python scripts/overload_drill.py TARGET [--seconds 60] [--factor 4] [--high-share 0.25] [--set KEY=VALUE]

TARGET: a ``target: llmapi`` recipe or an HF model directory. Exits 1 when a refusal lacks Retry-After, an accepted
request fails, or the server does not serve correctly afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

BODY = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
LOW, HIGH = 0.1, 0.9


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tracing():
    """aiohttp trace hooks that time each request's TCP connect (``ctx["connect"]``): a wait in the server's
    listen backlog (a dropped SYN is retried after 1 s) shows there, a wait in the server's event loop after it."""
    import aiohttp

    async def start(session, ctx, params):
        ctx.trace_request_ctx["connect_t0"] = time.perf_counter()

    async def end(session, ctx, params):
        ctx.trace_request_ctx["connect"] = time.perf_counter() - ctx.trace_request_ctx["connect_t0"]

    tc = aiohttp.TraceConfig()
    tc.on_connection_create_start.append(start)
    tc.on_connection_create_end.append(end)
    return [tc]


async def _one(session, url: str, priority: float, out: list) -> None:
    t0 = time.perf_counter()
    ctx: dict = {}
    try:
        async with session.post(
            url + "/v1/completions", json={**BODY, "priority": priority}, trace_request_ctx=ctx
        ) as r:
            first = time.perf_counter() - t0  # the status line and headers: a refusal is complete here
            data = await r.read()
            out.append(
                {
                    "status": r.status,
                    "priority": priority,
                    "retry_after": r.headers.get("Retry-After"),
                    "t_headers": first,
                    "t_total": time.perf_counter() - t0,
                    "t_connect": ctx.get("connect", 0.0),
                    "shed": r.status == 429 and b"shed for a request of higher priority" in data,
                    "ok": r.status == 200 and isinstance(json.loads(data)["choices"][0]["text"], str),
                }
            )
    except Exception as exc:  # noqa: BLE001 - counted as a failure of the drill
        out.append(
            {
                "status": f"{type(exc).__name__}",
                "priority": priority,
                "retry_after": None,
                "t_headers": time.perf_counter() - t0,
                "t_total": time.perf_counter() - t0,
                "t_connect": ctx.get("connect", 0.0),
                "ok": False,
            }
        )


async def _capacity(url: str, concurrency: int, seconds: float) -> float:
    """Completed requests per second with ``concurrency`` clients back to back (the server saturated)."""
    import aiohttp

    done: list = []
    end = time.perf_counter() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:

        async def client():
            while time.perf_counter() < end:
                await _one(s, url, 0.5, done)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return sum(1 for d in done if d["ok"]) / elapsed


async def _overload(
    url: str, rate: float, seconds: float, high_share: float, rss, seed: int
) -> tuple[list, float, list]:
    """Open-loop arrivals at ``rate`` per second for ``seconds``; returns (results, peak RSS seen meanwhile, the
    client's event-loop lags)."""
    import aiohttp

    rng = random.Random(seed)
    out: list = []
    peak = rss()
    conn = aiohttp.TCPConnector(limit=0)
    lags: list = []

    async def probe():  # the client's own event-loop lag: how late a 10 ms sleep wakes (a slow client, not server)
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    prober = asyncio.create_task(probe())
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=1200), trace_configs=_tracing()
    ) as s:
        tasks, t0, n = [], time.perf_counter(), 0
        while (now := time.perf_counter() - t0) < seconds:
            while n < rate * now:  # every arrival due by now (a late loop catches up rather than lowering the rate)
                tasks.append(asyncio.create_task(_one(s, url, HIGH if rng.random() < high_share else LOW, out)))
                n += 1
            if n % 50 == 0:
                peak = max(peak, rss())
            await asyncio.sleep(0.002)
        while any(not t.done() for t in tasks):
            peak = max(peak, rss())
            await asyncio.sleep(0.2)
    prober.cancel()
    return out, peak, lags


def _listen_drops() -> dict:
    """The kernel's listen-queue counters (this network namespace): connections the accept backlog could not take."""
    try:
        rows = [ln.split() for ln in Path("/proc/net/netstat").read_text().splitlines() if ln.startswith("TcpExt:")]
    except OSError:
        return {}
    table = dict(zip(rows[0][1:], map(int, rows[1][1:]))) if len(rows) >= 2 else {}
    return {k: table[k] for k in ("ListenOverflows", "ListenDrops") if k in table}


def _greedy(url: str) -> tuple[int, str]:
    import urllib.request

    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(BODY).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.status, json.loads(r.read())["choices"][0]["text"]


def main() -> int:
    import psutil

    from trtpipe.processes import sigterm_as_interrupt
    from trtpipe.app.launch_openai import resolve_openai_target, start_detached

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--factor", type=float, default=4.0, help="offered load / measured capacity")
    ap.add_argument(
        "--high-share", type=float, default=0.25, help=f"share of requests at priority {HIGH} (the rest {LOW})"
    )
    ap.add_argument("--capacity-seconds", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    args = ap.parse_args()
    sigterm_as_interrupt()
    target = resolve_openai_target(args.target, args.set, port=args.port)
    server = start_detached(target, args.set, timeout=600)
    url = server.http_url
    proc = psutil.Process(server.pid)
    rss = lambda: proc.memory_info().rss  # noqa: E731
    try:
        status, before_text = _greedy(url)
        batch = target.config.max_batch_size if target.config else 8
        capacity = asyncio.run(_capacity(url, 2 * batch, args.capacity_seconds))  # twice the batch: always work queued
        rss_before = rss()
        rate = args.factor * capacity
        drops0 = _listen_drops()
        t0 = time.perf_counter()
        results, peak, lags = asyncio.run(_overload(url, rate, args.seconds, args.high_share, rss, args.seed))
        drill_s = time.perf_counter() - t0
        drops = {k: v - drops0.get(k, 0) for k, v in _listen_drops().items()}
        rss_after = rss()
        import urllib.request

        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            health = r.status
        after_status, after_text = _greedy(url)
    finally:
        server.stop()
    refused = [r for r in results if r["status"] in (429, 503)]
    accepted = [r for r in results if r["status"] == 200]
    other = [r for r in results if r["status"] not in (200, 429, 503)]
    by_priority = {}
    for p in (LOW, HIGH):
        mine = [r for r in results if r["priority"] == p]
        by_priority[str(p)] = {
            "offered": len(mine),
            "accepted": sum(1 for r in mine if r["status"] == 200),
            "refused": sum(1 for r in mine if r["status"] in (429, 503)),
        }
    ms = lambda xs: {k: round(1e3 * _pct(xs, q), 1) for k, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))}  # noqa
    summary = {
        "capacity_rps": round(capacity, 2),
        "offered_rps": round(rate, 2),
        "seconds": args.seconds,
        "drill_wall_s": round(drill_s, 1),
        "offered": len(results),
        "accepted": len(accepted),
        "accepted_completed": sum(1 for r in accepted if r["ok"]),
        "refused": len(refused),
        "refused_by_status": {str(s): sum(1 for r in refused if r["status"] == s) for s in (429, 503)},
        "refused_with_retry_after": sum(1 for r in refused if r["retry_after"]),
        "time_to_reject_ms": ms([r["t_headers"] for r in refused]),
        # of which: the TCP connect (listen backlog) and the rest (the server's event loop, the answer)
        "time_to_reject_connect_ms": ms([r["t_connect"] for r in refused]),
        "time_to_reject_after_connect_ms": ms([r["t_headers"] - r["t_connect"] for r in refused]),
        # refused at arrival, and shed: queued, then pushed out by a higher priority (its wait is its queue time)
        "time_to_reject_at_arrival_ms": ms([r["t_headers"] for r in refused if not r.get("shed")]),
        "shed": sum(1 for r in refused if r.get("shed")),
        "time_to_shed_ms": ms([r["t_headers"] for r in refused if r.get("shed")]),
        "retry_after_s": ms([float(r["retry_after"]) / 1e3 for r in refused if r["retry_after"]]),
        "client_loop_lag_ms": ms(lags),  # a reply the client's loop reads late counts as a slow rejection
        "accepted_latency_ms": ms([r["t_total"] for r in accepted]),
        "other": {str(s): sum(1 for r in other if r["status"] == s) for s in {r["status"] for r in other}},
        "by_priority": by_priority,
        "listen_queue_drops": drops,
        "rss_mib": {
            "before": round(rss_before / 2**20, 1),
            "peak": round(peak / 2**20, 1),
            "after": round(rss_after / 2**20, 1),
        },
        "after": {"health": health, "greedy_status": after_status, "same_text_as_before": after_text == before_text},
    }
    print(json.dumps(summary, indent=2))
    bad = (
        other
        or summary["refused_with_retry_after"] != len(refused)
        or summary["accepted_completed"] != len(accepted)
        or health != 200
        or after_text != before_text
        or status != 200
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
