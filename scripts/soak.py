"""Soak the served twin: many streaming requests of mixed lengths, some cancelled by the client, while the RSS of
every server process (tritonserver and each python-backend stub) and the server's /dev/shm regions are sampled.

    python scripts/soak.py REPO [--requests 2000] [--concurrency 4] [--cancel 0.1] [--model M] [--seed 0] [--out soak.json]

REPO must be a streaming repository (recipe ``triton.streaming: true``); a server is started on 127.0.0.1 and
stopped at the end. Prints a table of RSS over time (MB per process) and a JSON summary: requests done,
cancelled, errors by kind, RSS growth after warm-up (first 10 % of requests), shm regions during and after.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

WORDS = (
    "Once upon a time there was a little girl named Lily who liked to play in the park with her dog "
    "and one day she found a big red ball under a tree"
).split()


def prompt(rng: random.Random) -> str:
    """A prompt of 1 to ~120 words (mixed lengths)."""
    n = rng.choice([1, 3, 8, 20, 60, 120])
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


INSTANCE = ("_0_0", "_0_1", "_0_2", "_0_3")  # a stub's model instance name ends its command line


def processes(server_pid: int) -> dict[str, psutil.Process]:
    """tritonserver and its descendants, named by role (stub: its model instance)."""
    root = psutil.Process(server_pid)
    out = {"tritonserver": root}
    for p in root.children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "trtpipe.triton.stub_watchdog" in cmd:  # a stub's watchdog process: named after its stub
            try:
                stub = next(c for c in psutil.Process(p.ppid()).cmdline() if c.endswith(INSTANCE))
            except (psutil.Error, StopIteration):
                stub = str(p.ppid())
            out[f"watchdog of {stub}"] = p
            continue
        name = next((c for c in cmd if c.endswith(INSTANCE)), p.name())
        out[name] = p
    return out


def rss_mb(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in procs.items():
        try:
            out[name] = round(p.memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[name] = float("nan")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--cancel", type=float, default=0.1, help="fraction of requests the client cancels midway")
    ap.add_argument(
        "--model",
        default=None,
        help="the model the clients stream through (default: the client's front model, the BLS when "
        "the repository has one; 'ensemble' or 'tensorrt_llm' exercise the other paths)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop issuing requests after this long (the summary says how many ran)",
    )
    args = ap.parse_args()
    from trtpipe.processes import sigterm_as_interrupt

    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us

    from trtpipe.processes import SHM_DIR
    from trtpipe.triton.client import Client, GenerateOptions
    from trtpipe.triton.server_process import start_server

    rng = random.Random(args.seed)
    plan = [
        (prompt(rng), rng.choice([4, 16, 32, 64, 128, 200]), rng.random() < args.cancel) for _ in range(args.requests)
    ]
    counts: Counter = Counter()
    errors: Counter = Counter()
    done = [0]
    lock = threading.Lock()
    samples: list[tuple[float, int, dict]] = []
    started = time.monotonic()
    with start_server(args.repo, timeout=300) as server:
        procs = processes(server.pid)
        shm_start = sorted(p.name for p in SHM_DIR.glob(f"{server.shm_prefix}*"))
        shm_peak = [len(shm_start)]
        stop = threading.Event()

        def sampler():
            while not stop.is_set():
                with lock:
                    n = done[0]
                samples.append((round(time.monotonic() - started, 1), n, rss_mb(procs)))
                print(f"{samples[-1][0]:>7} s {n:>5} done  {dict(counts)}  rss MB {samples[-1][2]}", flush=True)
                shm_peak[0] = max(shm_peak[0], len(list(SHM_DIR.glob(f"{server.shm_prefix}*"))))
                stop.wait(args.sample_s)

        def worker(k: int):
            with Client(server.grpc_url, model=args.model) as client:
                for i in range(k, len(plan), args.concurrency):
                    if args.max_seconds is not None and time.monotonic() - started > args.max_seconds:
                        return
                    text, max_tokens, cancel = plan[i]
                    try:
                        pieces = 0
                        for _ in client.stream(text, GenerateOptions(max_tokens=max_tokens)):
                            pieces += 1
                            if cancel and pieces >= 2:
                                break  # the client goes away: the stream is cancelled
                        counts["cancelled" if cancel else "completed"] += 1
                    except Exception as exc:  # noqa: BLE001 - counted and reported
                        errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                        counts["cancelled-error" if cancel else "error"] += 1
                    with lock:
                        done[0] += 1

        t = threading.Thread(target=sampler, daemon=True)
        t.start()
        workers = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(args.concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        stop.set()
        t.join()
        samples.append((round(time.monotonic() - started, 1), done[0], rss_mb(procs)))
        shm_end_live = sorted(p.name for p in SHM_DIR.glob(f"{server.shm_prefix}*"))
        prefix = server.shm_prefix
    shm_after_stop = sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))

    warm = next((s for s in samples if s[1] >= done[0] // 10), samples[0])  # warm-up: the first 10 % done
    last = samples[-1]
    growth = {name: round(100 * (last[2][name] / warm[2][name] - 1), 1) for name in last[2] if warm[2].get(name)}
    names = sorted(last[2])
    print("t_s  requests  " + "  ".join(f"{n[:24]:>24}" for n in names))
    step = max(1, len(samples) // 12)
    for s in samples[::step] + [samples[-1]]:
        print(f"{s[0]:>5} {s[1]:>8}  " + "  ".join(f"{s[2].get(n, float('nan')):>24}" for n in names))
    summary = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "done": done[0],
        "outcomes": dict(counts),
        "errors": dict(errors),
        "seconds": round(time.monotonic() - started, 1),
        "rss_mb_after_warmup": warm[2],
        "rss_mb_end": last[2],
        "rss_growth_pct_after_warmup": growth,
        "shm_regions_start": len(shm_start),
        "shm_regions_peak": shm_peak[0],
        "shm_regions_end_live": len(shm_end_live),
        "shm_left_after_stop": shm_after_stop,
        "ok": not shm_after_stop and counts["error"] == 0 and all(g < 10 for g in growth.values()),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({**summary, "samples": samples}, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
