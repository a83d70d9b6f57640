"""Interactive time-to-first-token on the OpenAI twin: alone, under a saturating batch load at the same priority,
and under the same batch load sent at low priority (the interactive requests high), all in one run on one server.

A steady open-loop interactive load (streamed, short) runs through three phases of ``--seconds`` each; in the last
two, ``--batch-clients`` closed-loop clients keep the server saturated with longer requests. Printed as one JSON
summary: TTFT p50/p99 per phase, each phase's p99 as a ratio of the alone p99 (same run, so the ratio, not the
milliseconds, is what carries over to another machine), and the batch throughput each phase kept::

    python scripts/priority_ttft.py TARGET [--seconds 20] [--interactive-rps 2] [--batch-clients 24]

TARGET: a ``target: llmapi`` recipe or an HF model directory, served as ``trtpipe serve --detach`` would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

INTERACTIVE = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
BATCH = {"prompt": "The little dog ran to the park and", "max_tokens": 64, "temperature": 0}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _ttft(session, url: str, priority: float, out: list) -> None:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={**INTERACTIVE, "priority": priority}) as r:
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text": ""' not in line:
                first = time.perf_counter() - t0
        out.append(first if r.status == 200 and first is not None else None)


async def _phase(url: str, seconds: float, rps: float, batch_clients: int, batch_p: float, inter_p: float,
                 seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    ttfts: list = []
    batch_done = [0]
    stop = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1200)) as s:
        async def batch_client():
            while time.perf_counter() < stop:
                async with s.post(url + "/v1/completions", json={**BATCH, "priority": batch_p}) as r:
                    await r.read()
                    batch_done[0] += r.status == 200

        async def interactive():
            tasks, t = [], time.perf_counter()
            while t < stop:
                tasks.append(asyncio.create_task(_ttft(s, url, inter_p, ttfts)))
                await asyncio.sleep(rng.expovariate(rps))
                t = time.perf_counter()
            await asyncio.gather(*tasks)

        t0 = time.perf_counter()
        await asyncio.gather(interactive(), *(batch_client() for _ in range(batch_clients)))
        wall = time.perf_counter() - t0
    ok = [x for x in ttfts if x is not None]
    return {"interactive": len(ttfts), "failed": len(ttfts) - len(ok), "ttft_p50_ms": round(1e3 * _pct(ok, 0.5), 1),
            "ttft_p99_ms": round(1e3 * _pct(ok, 0.99), 1), "batch_completed_per_s": round(batch_done[0] / wall, 2)}


def main() -> int:
    from trtpipe.processes import sigterm_as_interrupt
    from trtpipe.serving.openai_launch import resolve_openai_target, start_detached

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interactive-rps", type=float, default=2.0)
    ap.add_argument("--batch-clients", type=int, default=24, help="closed-loop batch clients (3x an 8-slot batch)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    args = ap.parse_args()
    sigterm_as_interrupt()
    target = resolve_openai_target(args.target, args.set, port=args.port)
    server = start_detached(target, args.set, timeout=600)
    try:
        run = lambda clients, bp, ip: asyncio.run(_phase(server.http_url, args.seconds, args.interactive_rps,  # noqa
                                                         clients, bp, ip, args.seed))
        phases = {"alone": run(0, 0.5, 0.5),
                  "with_batch_same_priority": run(args.batch_clients, 0.5, 0.5),
                  "with_batch_low_priority": run(args.batch_clients, 0.1, 0.9)}
    finally:
        server.stop()
    base = phases["alone"]["ttft_p99_ms"]
    for p in phases.values():
        p["p99_vs_alone"] = round(p["ttft_p99_ms"] / base, 2) if base else None
    print(json.dumps({"seconds_per_phase": args.seconds, "interactive_rps": args.interactive_rps,
                      "batch_clients": args.batch_clients, "phases": phases}, indent=2))
    return 1 if any(p["failed"] for p in phases.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
