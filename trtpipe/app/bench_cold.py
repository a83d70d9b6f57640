"""Cold start: how long a fresh server takes to become ready, and what its first request costs against the
requests after it.

A real deployment pays for lazy initialisation on the first request (allocator growth, first kernel runs,
tokenizer caches, the first BLS round trip); Triton's ``model_warmup`` moves that cost before the server
reports ready. This measures both sides on a server started here: time to ready, then one request (cold),
then ``warm_requests`` more, each timed to its first and last streamed response.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

from trtpipe.bench.metrics import BenchError
from trtpipe.bench.target import resolve_target

PROMPTS = (
    "Once upon a time",
    "Lily and Tom went to the park",
    "The cat saw a big red ball",
    "One day, a little bird",
    "Sam wanted to play with his dog",
    "The sun was hot and",
)


def timed_request(
    http_url: str, model: str, streaming: bool, prompt: str, max_tokens: int, timeout: float = 120.0
) -> dict:
    """One generate (or generate_stream) request: ms to the first and to the last response, pieces received."""
    u = urlparse(http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {"text_input": prompt, "max_tokens": max_tokens}
    path = f"/v2/models/{model}/generate"
    if streaming:
        body["stream"] = True
        path += "_stream"
    t0 = time.perf_counter()
    first = None
    pieces = 0
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise BenchError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            if line.startswith(b"data:"):
                line = line[5:].strip()
            event = json.loads(line)
            if "error" in event:
                raise BenchError(f"{path}: {event['error']}")
            if event.get("text_output"):
                pieces += 1
                if first is None:
                    first = time.perf_counter()
            if not streaming:
                break
    finally:
        conn.close()
    end = time.perf_counter()
    return {"ttft_ms": 1000.0 * ((first or end) - t0), "e2e_ms": 1000.0 * (end - t0), "pieces": pieces}


def measure_cold(
    recipe: Path, overrides: Sequence[str] = (), warm_requests: int = 5, max_tokens: int = 16, timeout: float = 300.0
) -> dict:
    """Start a fresh server for ``recipe`` (built if needed), time readiness, the first and the next requests."""
    from trtpipe.app.launch_triton import has_warmup, resolve_repo
    from trtpipe.triton.server_process import start_server

    repo = resolve_repo(recipe, overrides, quiet=True)
    t0 = time.perf_counter()
    with start_server(repo, timeout=timeout) as server:
        ready_s = time.perf_counter() - t0
        target = resolve_target(server.http_url, None, repo=Path(repo))
        runs = [
            timed_request(server.http_url, target.model, target.streaming, PROMPTS[i % len(PROMPTS)], max_tokens)
            for i in range(warm_requests + 1)
        ]
    cold, warm = runs[0], runs[1:]
    out = {
        "recipe": str(recipe),
        "overrides": list(overrides),
        "repo": str(repo),
        "model_warmup": has_warmup(repo),
        "model": target.model,
        "streaming": target.streaming,
        "max_tokens": max_tokens,
        "ready_s": ready_s,
        "cold": cold,
        "warm": warm,
        "warm_median": {k: statistics.median(r[k] for r in warm) for k in ("ttft_ms", "e2e_ms")},
    }
    med = out["warm_median"]
    out["cold_over_warm"] = {k: cold[k] / med[k] if med[k] else None for k in ("ttft_ms", "e2e_ms")}
    return out


def render(r: dict) -> str:
    med, ratio = r["warm_median"], r["cold_over_warm"]
    return "\n".join(
        [
            f"{r['recipe']} (model_warmup {'on' if r['model_warmup'] else 'off'}): ready in {r['ready_s']:.2f} s",
            f"  first request (cold): ttft {r['cold']['ttft_ms']:.1f} ms, e2e {r['cold']['e2e_ms']:.1f} ms",
            f"  next {len(r['warm'])} (warm), median: ttft {med['ttft_ms']:.1f} ms, e2e {med['e2e_ms']:.1f} ms",
            f"  cold / warm: ttft {ratio['ttft_ms']:.2f}x, e2e {ratio['e2e_ms']:.2f}x",
        ]
    )
