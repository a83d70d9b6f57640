"""The cost of constraining: output tokens per second of the OpenAI twin at concurrency 1 and 8, with and without
a JSON schema (``response_format`` json_schema), in one run on one server.

Closed-loop clients send ``--requests`` chat-free completions each round (sampled, seeded, ``--max-tokens``); a
round's output tok/s is the completion tokens it got over its wall time. Each (concurrency, schema) round runs after
one warm-up request of its own kind (the schema is compiled once, then cached: the rounds measure the steady state,
and the compile time is printed from the server's own counter). Printed as one JSON summary with each constrained
rate (the median of ``--repeats`` rounds, the two modes alternating) as a ratio of the unconstrained one at the same
concurrency (same run: the ratio, not the absolute rate, is what carries over to another machine). Beside the
wall-clock rate, the process CPU time per output token (server and client share the process): on a shared machine
other tenants stretch the wall clock far more than the CPU time::

    python scripts/bench_guided.py [MODEL_DIR] [--requests 32] [--max-tokens 64] [--concurrency 1,8] [--repeats 3]

MODEL_DIR: an HF model directory (default: models/stories260k, the shipped 260k-parameter Llama).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import statistics
import threading
import time
from pathlib import Path

SCHEMA = {  # nested objects, an enum, a bounded array, a pattern and numbers: every facet the tests use
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["dog", "cat", "bird"]}, "legs": {"type": "integer", "minimum": 0}},
            "required": ["kind", "legs"],
        },
        "toys": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["name", "pet", "toys", "score"],
}


def _serve(model_dir: Path):
    """The OpenAI twin of ``model_dir`` (xgrammar on) on a free loopback port, from a thread: (url, served)."""
    import socket

    from aiohttp import web

    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    max_seq = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 512)
    served = ServedModel(
        model_dir, "bench", dataclasses.replace(twin_default(max_seq), guided_decoding_backend="xgrammar")
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop, runner, ready = asyncio.new_event_loop(), web.AppRunner(OpenAIServer(served).app), threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(60)
    return f"http://127.0.0.1:{port}", served


async def _round(url: str, concurrency: int, requests: int, max_tokens: int, schema: bool, seed0: int) -> dict:
    import aiohttp

    body = {"model": "bench", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 1.0}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    todo = list(range(requests))
    tokens = [0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:

        async def one(seed: int) -> None:
            async with s.post(url + "/v1/completions", json={**body, "seed": seed}) as r:
                out = await r.json()
                assert r.status == 200, out
                tokens[0] += out["usage"]["completion_tokens"]

        await one(seed0 - 1)  # warm-up of this kind (compiles the schema on its first use)
        tokens[0] = 0

        async def client() -> None:
            while todo:
                await one(seed0 + todo.pop())

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "tokens": tokens[0],
        "seconds": round(wall, 3),
        "tok_s": round(tokens[0] / wall, 2),
        "cpu_ms_per_token": round(1e3 * cpu / tokens[0], 3),
    }


def _counters(url: str) -> dict:
    import urllib.request

    text = urllib.request.urlopen(url + "/prometheus/metrics", timeout=60).read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r"^(trtpipe_guided_\w+)\{[^}]*\} (\S+)$", text, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", nargs="?", default=str(Path(__file__).resolve().parents[1] / "models/stories260k"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds per (concurrency, schema); median kept")
    a = ap.parse_args()
    url, served = _serve(Path(a.model_dir))
    runs: dict = {}
    for c in [int(x) for x in a.concurrency.split(",")]:
        for _ in range(a.repeats):  # alternating, so a shared machine's drifting load falls on both modes alike
            for schema in (False, True):  # the same seeds in both modes
                runs.setdefault((c, schema), []).append(
                    asyncio.run(_round(url, c, a.requests, a.max_tokens, schema, seed0=1000))
                )
    median = {k: statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_ms_per_token"] for r in v) for k, v in runs.items()}
    summary = {
        "model_dir": a.model_dir,
        "requests": a.requests,
        "max_tokens": a.max_tokens,
        "repeats": a.repeats,
        "rows": [
            {
                "concurrency": c,
                "schema": schema,
                "median_tok_s": round(median[(c, schema)], 2),
                "tok_s_each": [r["tok_s"] for r in v],
                "tokens_each": [r["tokens"] for r in v],
                "ratio_to_unconstrained": round(median[(c, schema)] / median[(c, False)], 3),
                "median_cpu_ms_per_token": cpu[(c, schema)],
                "cpu_ms_per_token_each": [r["cpu_ms_per_token"] for r in v],
                "cpu_ratio_to_unconstrained": round(cpu[(c, schema)] / cpu[(c, False)], 3),
            }
            for (c, schema), v in runs.items()
        ],
        "guided_counters": _counters(url),
    }
    served.shutdown()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
