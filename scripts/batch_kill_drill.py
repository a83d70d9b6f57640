#!/usr/bin/env python3
"""Kill drill of ``trtpipe batch``: a greedy batch job killed with ``kill -9`` at random moments, resumed each time.

It serves the recipe (the OpenAI twin, ``trtpipe serve-openai``), runs the batch once uninterrupted (the
reference), then runs it again into a fresh output and kills it ``--kills`` times at random moments: the batch
client each time but one, and once the server (which this script restarts on the same port while the client
waits for it). After each kill the same command is started again and resumes. At the end it checks, and prints:
every custom_id exactly once across the output and errors files, none missing, none extra, and each answer equal
to the reference run's (greedy requests, so equal text, finish reason and token counts). Exit 1 when any check
fails. A few requests are invalid on purpose (max_tokens -1): they must land in the errors file, also once.

    python scripts/batch_kill_drill.py                      # 2,000 requests, 5 kills
    python scripts/batch_kill_drill.py --requests 200 --kills 2 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ["Tom", "Lily", "the dog", "a bird", "Ben", "Sue", "the cat", "Max", "a frog", "the sun", "Mom", "a boy"]
INVALID_EVERY = 250  # request i with i % INVALID_EVERY == 7 has max_tokens -1 (a 400: the errors file)


def write_requests(path: Path, n: int, max_tokens: int) -> None:
    """``n`` greedy completions with varied prompts (OpenAI Batch input lines)."""
    with open(path, "w") as f:
        for i in range(n):
            w = len(WORDS)
            prompt = f"Once upon a time, {WORDS[i % w]} saw {WORDS[(i // w) % w]} near {WORDS[(i // w // w) % w]}"
            body = {"prompt": prompt, "max_tokens": -1 if i % INVALID_EVERY == 7 else max_tokens, "temperature": 0}
            f.write(
                json.dumps({"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(recipe: Path, port: int, log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trtpipe.cli", "serve-openai", str(recipe), "--port", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    deadline = time.monotonic() + 600
    while not healthy(f"http://127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start; log {log}")
        time.sleep(0.2)
    return proc


def batch_cmd(url: str, req: Path, out: Path, concurrency: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trtpipe.cli",
        "batch",
        url,
        "-i",
        str(req),
        "-o",
        str(out),
        "-c",
        str(concurrency),
        "--no-progress",
        "--checkpoint-interval",
        "2",
    ]


def lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_bytes().split(b"\n") if x.strip()]


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def answer(rec: dict):
    """What a greedy answer must repeat: text, finish reason, token counts (or the error status and message)."""
    body = rec["response"]["body"] if rec.get("response") else rec.get("error")
    if rec.get("response") and rec["response"]["status_code"] == 200:
        c = body["choices"][0]
        return c["text"], c["finish_reason"], body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    return rec["response"]["status_code"] if rec.get("response") else None, json.dumps(body, sort_keys=True)


def check(req: Path, out: Path, err: Path, ref_out: Path, ref_err: Path) -> dict:
    wanted = [json.loads(x)["custom_id"] for x in req.read_text().splitlines() if x.strip()]
    got = lines(out) + lines(err)
    counts = Counter(r["custom_id"] for r in got)
    ref = {r["custom_id"]: answer(r) for r in lines(ref_out) + lines(ref_err)}
    mine = {r["custom_id"]: answer(r) for r in got}
    return {
        "requests": len(wanted),
        "lines_written": len(got),
        "succeeded": count_lines(out),
        "failed": count_lines(err),
        "duplicates": sum(1 for c in counts.values() if c > 1),
        "missing": len(set(wanted) - set(counts)),
        "extra": len(set(counts) - set(wanted)),
        "reference_complete": len(ref) == len(wanted),
        "answers_differing": sum(1 for c in wanted if c in ref and mine.get(c) != ref[c]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "stories-llmapi-fp8.yaml")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=5, help="kill -9 count; one of them kills the server")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, help="where the files go (default: a temporary directory)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.dir or Path(tempfile.mkdtemp(prefix="batch-drill-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    req, ref_out, out = work / "requests.jsonl", work / "reference.jsonl", work / "results.jsonl"
    ref_err, err = work / "reference.errors.jsonl", work / "results.errors.jsonl"
    write_requests(req, args.requests, args.max_tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t_all = time.monotonic()
    server = start_server(args.recipe, port, work / "server.log", env)
    kills: list[str] = []
    client = None
    try:
        t0 = time.monotonic()
        ref = subprocess.run(
            batch_cmd(url, req, ref_out, args.concurrency), env=env, cwd=REPO, capture_output=True, text=True
        )
        t_ref = time.monotonic() - t0
        print(f"reference run: {args.requests} requests, uninterrupted, exit {ref.returncode}, {t_ref:.1f} s")
        server_kill = rng.randrange(args.kills) if args.kills else -1
        t1 = time.monotonic()
        torn = 0
        runs = 0
        rate = max(count_lines(ref_out) + count_lines(ref_err), 1) / t_ref
        for k in range(args.kills):
            if client is None:
                log = open(work / f"run{runs}.log", "w")
                client = subprocess.Popen(
                    batch_cmd(url, req, out, args.concurrency), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
                )
                runs += 1
            remaining = args.requests - count_lines(out) - count_lines(err)
            delay = 2.0 + rng.uniform(0.0, 0.6) * remaining / rate / max(args.kills - k, 1)
            time.sleep(delay)
            before = count_lines(out) + count_lines(err)
            if client.poll() is not None:
                kills.append(f"kill {k + 1}: the client had exited ({client.returncode}) before it ({before} lines)")
                client = None
                continue
            if k == server_kill:  # the client keeps running: it waits for the server, then goes on
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
                kills.append(f"kill {k + 1}: server (pid {server.pid}) after {delay:.1f} s, {before} lines written")
                time.sleep(1.0)
                server = start_server(args.recipe, port, work / "server.log", env)
            else:
                os.kill(client.pid, signal.SIGKILL)
                client.wait()
                kills.append(f"kill {k + 1}: client (pid {client.pid}) after {delay:.1f} s, {before} lines written")
                client = None
        if client is not None:  # the one that outlived the server kill finishes the job
            client.wait()
        final = subprocess.run(
            batch_cmd(url, req, out, args.concurrency), env=env, cwd=REPO, capture_output=True, text=True
        )
        runs += 1
        for p in sorted(work.glob("run*.log")):
            torn += p.read_text().count("recovered a torn last line")
        torn += final.stderr.count("recovered a torn last line")
        t_drill = time.monotonic() - t1
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    for line in kills:
        print(line)
    print(f"final run: exit {final.returncode}; " + (final.stdout.strip().splitlines() or [""])[0])
    result = check(req, out, err, ref_out, ref_err)
    result.update(
        {
            "kills": len([k for k in kills if "had exited" not in k]),
            "client_runs": runs,
            "torn_lines_recovered": torn,
            "reference_s": round(t_ref, 1),
            "drill_s": round(t_drill, 1),
            "wall_s": round(time.monotonic() - t_all, 1),
            "dir": str(work),
        }
    )
    print(json.dumps(result, indent=1))
    ok = (
        result["duplicates"] == result["missing"] == result["extra"] == result["answers_differing"] == 0
        and result["reference_complete"]
        and result["lines_written"] == args.requests
        and final.returncode in (0, 3)
    )
    print("drill:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
