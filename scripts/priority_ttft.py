"""Interactive time-to-first-token on the OpenAI twin: alone, under a saturating batch load at the same priority,
and under the same batch load sent at low priority (the interactive requests high), all in one run on one server.

A steady open-loop interactive load (streamed, short) runs through three phases of ``--seconds`` each; in the last
two, ``--batch-clients`` closed-loop clients keep the server saturated with longer requests. The batch load runs in
its own process, as a batch job would: sharing the measuring client's event loop, its 24 connections' reads
delayed the interactive first tokens the client timed. Printed as one JSON summary: TTFT p50/p99 per phase, each
phase's p99 as a ratio of the alone p99 (same run, so the ratio, not the milliseconds, is what carries over to
another machine), and the batch throughput each phase kept::

    python scripts/priority_ttft.py TARGET [--seconds 60] [--interactive-rps 4] [--batch-clients 24]

The defaults give about 240 interactive requests per phase, so p99 is not simply the slowest one.

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


async def _ttft(session, url: str, priority: float, prompt, out: list) -> None:
    t0 = time.perf_counter()
    body = {**INTERACTIVE, "priority": priority, **({"prompt": prompt} if prompt else {})}
    async with session.post(url + "/v1/completions", json=body) as r:
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text": ""' not in line:
                first = time.perf_counter() - t0
        out.append(first if r.status == 200 and first is not None else None)


async def _batch_load(url: str, seconds: float, clients: int, priority: float) -> dict:
    """``clients`` closed-loop batch clients for ``seconds`` (the batch process's body): completed per second."""
    import aiohttp

    done, stop = [0], time.perf_counter() + seconds
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=1200)
    ) as s:

        async def client():
            while time.perf_counter() < stop:
                async with s.post(url + "/v1/completions", json={**BATCH, "priority": priority}) as r:
                    await r.read()
                    done[0] += r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return {"batch_completed_per_s": round(done[0] / (time.perf_counter() - t0), 2)}


async def _phase(
    url: str,
    seconds: float,
    rps: float,
    batch_clients: int,
    batch_p: float,
    inter_p: float,
    seed: int,
    prompt_tokens: int,
    vocab: int,
) -> dict:
    import aiohttp

    rng = random.Random(seed)
    ttfts: list = []
    batch = None
    if batch_clients:
        batch = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--batch-load",
            url,
            "--seconds",
            str(seconds),
            "--batch-clients",
            str(batch_clients),
            "--batch-priority",
            str(batch_p),
            stdout=asyncio.subprocess.PIPE,
        )
        await asyncio.sleep(2.0)  # the batch saturates the server before the first interactive request
    stop = time.perf_counter() + seconds - (2.0 if batch else 0.0)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=1200)
    ) as s:
        tasks, t = [], time.perf_counter()
        while t < stop:
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]  # fresh: no cached prefix to reuse
            tasks.append(asyncio.create_task(_ttft(s, url, inter_p, prompt, ttfts)))
            await asyncio.sleep(rng.expovariate(rps))
            t = time.perf_counter()
        await asyncio.gather(*tasks)
    kept = {"batch_completed_per_s": 0.0}
    if batch:
        out, _ = await batch.communicate()
        if batch.returncode:
            raise SystemExit(f"the batch load process failed (exit {batch.returncode})")
        kept = json.loads(out)
    ok = [x for x in ttfts if x is not None]
    return {
        "interactive": len(ttfts),
        "failed": len(ttfts) - len(ok),
        "ttft_p50_ms": round(1e3 * _pct(ok, 0.5), 1),
        "ttft_p90_ms": round(1e3 * _pct(ok, 0.9), 1),
        "ttft_p99_ms": round(1e3 * _pct(ok, 0.99), 1),
        **kept,
    }


def main() -> int:
    from trtpipe.processes import sigterm_as_interrupt
    from trtpipe.app.launch_openai import resolve_openai_target, start_detached

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", nargs="?", type=Path)
    ap.add_argument("--batch-load", metavar="URL", help=argparse.SUPPRESS)  # the batch process (internal)
    ap.add_argument("--batch-priority", type=float, default=0.5, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interactive-rps", type=float, default=4.0)
    ap.add_argument(
        "--interactive-prompt-tokens",
        type=int,
        default=192,
        help="each interactive prompt: this many random token ids, fresh per request (0: the short "
        "text prompt, where TTFT alone is one step and so waiting for one in-flight step doubles it)",
    )
    ap.add_argument("--batch-clients", type=int, default=24, help="closed-loop batch clients (3x an 8-slot batch)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    args = ap.parse_args()
    if args.batch_load:
        print(
            json.dumps(asyncio.run(_batch_load(args.batch_load, args.seconds, args.batch_clients, args.batch_priority)))
        )
        return 0
    if args.target is None:
        ap.error("TARGET is required")
    sigterm_as_interrupt()
    target = resolve_openai_target(args.target, args.set, port=args.port)
    server = start_detached(target, args.set, timeout=600)
    try:
        vocab = json.loads((target.model_dir / "config.json").read_text())["vocab_size"]
        run = lambda clients, bp, ip: asyncio.run(  # noqa: E731
            _phase(
                server.http_url,
                args.seconds,
                args.interactive_rps,  # noqa
                clients,
                bp,
                ip,
                args.seed,
                args.interactive_prompt_tokens,
                vocab,
            )
        )
        phases = {
            "alone": run(0, 0.5, 0.5),
            "with_batch_same_priority": run(args.batch_clients, 0.5, 0.5),
            "with_batch_low_priority": run(args.batch_clients, 0.1, 0.9),
        }
    finally:
        server.stop()
    base = phases["alone"]["ttft_p99_ms"]
    for p in phases.values():
        p["p99_vs_alone"] = round(p["ttft_p99_ms"] / base, 2) if base else None
    print(
        json.dumps(
            {
                "seconds_per_phase": args.seconds,
                "interactive_rps": args.interactive_rps,
                "interactive_prompt_tokens": args.interactive_prompt_tokens,
                "batch_clients": args.batch_clients,
                "phases": phases,
            },
            indent=2,
        )
    )
    return 1 if any(p["failed"] for p in phases.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
