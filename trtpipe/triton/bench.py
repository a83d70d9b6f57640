"""``trtpipe bench``: N requests with C in flight against a running server; throughput and latency percentiles.

Loopback by default and bounded: exactly ``num_requests`` requests, each worker thread holding its own
connection. Latency is wall time per request as the client sees it; failed requests are counted, not retried.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np

from trtpipe.errors import ServingError
from trtpipe.triton.client import Client, GenerateOptions

PERCENTILES = (50, 90, 99)


def run_bench(url: str, protocol: str, prompt: str, opts: GenerateOptions, concurrency: int, num_requests: int,
              model: Optional[str] = None) -> dict:
    """Run the benchmark; return the numbers and a printable ``text``."""
    latencies: list[float] = []
    errors: list[str] = []
    chars: list[int] = []
    lock = threading.Lock()
    next_id = iter(range(num_requests))

    def worker() -> None:
        with Client(url, protocol, model) as client:
            while True:
                with lock:
                    i = next(next_id, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    text = client.generate(prompt, opts)
                except ServingError as exc:
                    with lock:
                        errors.append(str(exc))
                    continue
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    chars.append(len(text))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, num_requests))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if not latencies:  # nothing was measured: no throughput or latency to report
        raise ServingError(f"all {num_requests} requests failed; first error: {errors[0]}")
    lat = np.array(latencies) * 1000.0
    report = {
        "url": url,
        "requests": num_requests,
        "concurrency": concurrency,
        "max_tokens": opts.max_tokens,
        "ok": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3) if wall > 0 else None,
        "latency_ms": {f"p{p}": round(float(np.percentile(lat, p)), 1) for p in PERCENTILES} if lat.size else {},
        "latency_ms_mean": round(float(lat.mean()), 1) if lat.size else None,
        "output_chars_mean": round(float(np.mean(chars)), 1) if chars else None,
    }
    pct = "  ".join(f"{k} {v} ms" for k, v in report["latency_ms"].items())
    report["text"] = (
        f"{report['ok']}/{num_requests} ok ({report['errors']} errors), concurrency {concurrency}, "
        f"max_tokens {opts.max_tokens}\n"
        f"throughput {report['requests_per_s']} req/s over {report['wall_s']} s\n"
        f"latency {pct}  mean {report['latency_ms_mean']} ms"
        + (f"\nfirst error: {errors[0]}" if errors else "")
    )
    return report
