#!/usr/bin/env python3
"""In-flight vs static batching on the served CPU twin, and prefix reuse on vs off, in one run.

Builds stories260k (fp16) as a twin engine, serves it on a real tritonserver twice per comparison (same
executor, both streaming; only the capacity policy differs: in-flight guaranteed_no_evict vs the executor's
STATIC_BATCH, set in the twin's config.pbtxt since Triton's parameter table does not offer it), and drives ``tensorrt_llm_bls/generate_stream`` over HTTP with a
closed loop of C streaming clients. Output lengths are fixed per request (end_id -1: no early stop) and mixed
(uniform 16..112, i.e. 64 +- 48). Prints TTFT p50/p99 and output tokens/s per concurrency and the ratios the
executor issue asks for. Machines here are noisy: compare numbers from the same run only.

    .venv/bin/python scripts/bench_inflight.py [--requests 48] [--concurrency 1,4,8,16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "models" / "stories260k"
WORDS = (
    "the a little girl boy dog cat ball park tree sun big red happy sad went saw played ran jumped wanted "
    "mom dad friend house garden flower bird fish toy car day night time once upon there was"
).split()


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream_once(host: str, port: int, text: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, e2e_s, chunks) of one streamed request."""
    body = json.dumps(
        {"text_input": text, "max_tokens": max_tokens, "stream": True, "end_id": -1, "exclude_input_in_output": True}
    )
    conn = http.client.HTTPConnection(host, port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v2/models/tensorrt_llm_bls/generate_stream", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, chunks = None, 0
    for line in resp:
        if line.startswith(b"data:"):
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            chunks += 1
            if ttft is None and event.get("text_output"):
                ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    conn.close()
    return (ttft if ttft is not None else e2e), e2e, chunks


def run_level(host, port, concurrency, work):
    """Closed loop: ``concurrency`` clients take requests from ``work`` until it is empty."""
    lock, results, errors = threading.Lock(), [], []
    queue = list(work)

    def client():
        while True:
            with lock:
                if not queue:
                    return
                text, n = queue.pop()
            try:
                ttft, e2e, _ = stream_once(host, port, text, n)
                with lock:
                    results.append((ttft, e2e, n))
            except Exception as exc:  # counted, never hidden
                with lock:
                    errors.append(str(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results] or [float("nan")]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(errors),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "output_tok_s": sum(r[2] for r in results) / wall,
        "wall_s": wall,
        "first_error": errors[0] if errors else None,
    }


def serve(engine, overrides, tmp, policy=None):
    """A real tritonserver on a fresh repository; ``policy`` overrides the twin's batch_scheduler_policy."""
    from trtpipe.triton.repo import write_repo
    from trtpipe.triton.server_process import start_server
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(REPO / "recipes" / "stories-fp16.yaml", ["triton.streaming=true", *overrides])
    repo = Path(tempfile.mkdtemp(dir=tmp)) / "repo"
    write_repo(recipe, engine, engine / "checkpoint", repo)
    if policy:  # static_batch: the executor's own static batching, which Triton's parameter table does not offer
        cfg = repo / "tensorrt_llm" / "config.pbtxt"
        text = cfg.read_text()
        key = 'key: "batch_scheduler_policy"\n  value {\n    string_value: "guaranteed_no_evict"'
        if key not in text:
            raise RuntimeError(f"{cfg}: batch_scheduler_policy not found")
        cfg.write_text(text.replace(key, key.replace("guaranteed_no_evict", policy)))
    return start_server(repo, timeout=240)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="requests per concurrency level")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--prompt-words", type=int, default=24, help="about 32 tokens")
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--modes", default="inflight,static", help="which batching modes to run")
    ap.add_argument("--skip-reuse", action="store_true", help="skip the prefix-reuse comparison")
    args = ap.parse_args()
    from trtpipe.processes import sigterm_as_interrupt

    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us
    levels = [int(c) for c in args.concurrency.split(",")]

    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    tmp = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    build = {
        "max_batch_size": 16,
        "max_input_len": 384,
        "max_seq_len": 512,
        "max_beam_width": 1,
        "max_num_tokens": 2048,
        "plugin_config": {"tokens_per_block": 32},
    }
    engine = write_twin_engine(convert(STORIES, tmp / "ckpt", tp=1, dtype="float16"), tmp / "engine", build)
    rng = random.Random(0)
    work = [(prompt_text(rng, args.prompt_words), rng.randint(16, 112)) for _ in range(args.requests)]
    common = ["engine.max_batch_size=16", "triton.max_batch_size=16", "engine.kv_cache.enable_reuse=false"]
    report = {"batching": {}, "reuse": {}}
    # static: the same executor with STATIC_BATCH (a batch runs to completion before the next forms), streaming on
    for mode, policy in (("inflight", None), ("static", "static_batch")):
        if mode not in args.modes.split(","):
            continue
        with serve(engine, common, tmp, policy) as server:
            host, port = server.http_url.replace("http://", "").split(":")
            stream_once(host, int(port), "warm up", 4)
            for c in levels:
                row = run_level(host, int(port), c, work)
                report["batching"].setdefault(mode, []).append(row)
                print(
                    f"{mode:8s} c={c:<3d} ttft p50 {row['ttft_p50_ms']:8.1f} ms  p99 {row['ttft_p99_ms']:8.1f} ms  "
                    f"{row['output_tok_s']:7.1f} tok/s  errors {row['errors']}"
                    + (f" (first: {row['first_error'][:160]})" if row["errors"] else ""),
                    flush=True,
                )
    inflight = {r["concurrency"]: r for r in report["batching"].get("inflight", [])}
    static = {r["concurrency"]: r for r in report["batching"].get("static", [])}
    if inflight:
        base = inflight[levels[0]]
        print("\nratios (same run):")
        for c in levels:
            vs_static = (
                f"   tok/s vs static: {inflight[c]['output_tok_s'] / static[c]['output_tok_s']:5.2f}x" if static else ""
            )
            print(
                f"  c={c:<3d} TTFT p50 vs c={levels[0]}: {inflight[c]['ttft_p50_ms'] / base['ttft_p50_ms']:5.2f}x   "
                f"tok/s vs c={levels[0]}: {inflight[c]['output_tok_s'] / base['output_tok_s']:5.2f}x" + vs_static
            )
    if args.skip_reuse:
        return 0

    # Prefix reuse: one shared prefix of about --prefix-tokens tokens, then a short distinct question.
    from transformers import AutoTokenizer

    tok, prng, prefix = AutoTokenizer.from_pretrained(STORIES, trust_remote_code=False), random.Random(1), ""
    while len(tok(prefix).input_ids) < args.prefix_tokens:
        prefix = (prefix + " " + prng.choice(WORDS)).strip()
    print(f"shared prefix: {len(tok(prefix).input_ids)} tokens", flush=True)
    questions = [(prefix + " " + prompt_text(rng, 6), 8) for _ in range(24)]
    for mode, flag in (("reuse-on", "true"), ("reuse-off", "false")):
        with serve(engine, ["engine.max_input_len=384", f"engine.kv_cache.enable_reuse={flag}"], tmp) as server:
            host, port = server.http_url.replace("http://", "").split(":")
            stream_once(host, int(port), prefix + " warm", 4)  # the first request fills the cache
            row = run_level(host, int(port), 1, questions)
            report["reuse"][mode] = row
            print(
                f"{mode:9s} TTFT p50 {row['ttft_p50_ms']:7.1f} ms  p99 {row['ttft_p99_ms']:7.1f} ms  errors {row['errors']}"
            )
    on, off = report["reuse"]["reuse-on"], report["reuse"]["reuse-off"]
    print(f"prefix reuse: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower with reuse")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
