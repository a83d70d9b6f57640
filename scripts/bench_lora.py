#!/usr/bin/env python3
"""Output tokens/s of a mixed-adapter batch against base-only requests on the OpenAI twin, in one run.

Makes four PEFT adapters of stories260k with peft (ranks 8 and 64, attention-only and all-linear, two with rsLoRA:
tests/lora_adapters.py), serves stories260k twice over HTTP from this process: the twin with the adapters
(``max_loras`` 4) and the plain twin (no LoRA attached). A closed loop of C clients (default 8) sends R completions
per phase; phases rotate ``rounds`` times so drift on a shared machine hits each alike:

- ``plain``: the twin without LoRA, base requests;
- ``base``: the LoRA twin, base requests (``model`` = the base): what attaching LoRA costs when unused;
- ``mixed``: the LoRA twin, requests round-robin over the four adapters (every step mixes them).

Output tokens come from each response's ``usage.completion_tokens`` (greedy; a request may end at EOS before
``max_tokens``). Prints the median tok/s per phase and the ratios. Compare numbers from the same run only.

    .venv/bin/python scripts/bench_lora.py [--requests 32] [--concurrency 8] [--max-tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "models" / "stories260k"
sys.path[:0] = [str(REPO), str(REPO / "tests")]
WORDS = "the a little girl boy dog cat ball park tree sun big red happy went saw played ran mom dad friend day".split()


def complete(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


def closed_loop(url: str, jobs: list[tuple[str, str]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """(output tokens, wall seconds) of ``jobs`` (model, prompt) sent by ``concurrency`` clients."""
    lock, it, total = threading.Lock(), iter(jobs), [0]

    def client():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            n = complete(url, job[0], job[1], max_tokens)
            with lock:
                total[0] += n

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each twin's executor")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # the twins' executors take this thread's setting
    from lora_adapters import make_all
    from openai_helpers import serve_in_thread

    from trtpipe.serving.adapters import LoraSettings
    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(args.requests)]
    config = twin_default(512, max_batch_size=args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_all(STORIES, Path(tmp))
        names = list(adapters)
        lora = ServedModel(STORIES, "base", config, lora=LoraSettings(adapters, 64, len(names), len(names)))
        plain = ServedModel(STORIES, "base", config)
        phases = {
            "plain": (plain, ["base"] * args.requests),
            "base": (lora, ["base"] * args.requests),
            "mixed": (lora, [names[i % len(names)] for i in range(args.requests)]),
        }
        rates: dict[str, list[float]] = {p: [] for p in phases}
        with serve_in_thread(OpenAIServer(lora).app) as lora_url, serve_in_thread(OpenAIServer(plain).app) as plain_url:
            urls = {"plain": plain_url, "base": lora_url, "mixed": lora_url}
            for model, url in ((plain, plain_url), (lora, lora_url)):  # warm up both (first-call allocations)
                closed_loop(url, [("base", p) for p in prompts[:4]], 4, 8)
            for r in range(args.rounds):
                for phase, (_, models) in phases.items():
                    tokens, wall = closed_loop(
                        urls[phase], list(zip(models, prompts)), args.concurrency, args.max_tokens
                    )
                    rates[phase].append(tokens / wall)
                    print(
                        f"round {r + 1} {phase:5s}: {tokens} output tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s"
                    )
        lora.shutdown()
        plain.shutdown()
    med = {p: statistics.median(v) for p, v in rates.items()}
    print(
        f"\nmedian output tok/s at concurrency {args.concurrency} ({args.rounds} rounds, {args.requests} requests each):"
    )
    for p, v in med.items():
        print(f"  {p:5s} {v:8.1f}")
    print(f"mixed / base  = {med['mixed'] / med['base']:.3f}")
    print(f"base  / plain = {med['base'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
