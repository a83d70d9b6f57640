"""Huge prompts against the OpenAI twin (issue 38, item 4): N prompts of M MB each at once, and one normal request
sent beside them. Prints the server's RSS (before, peak, 5 s after) and the normal request's latency, as JSON.

    python scripts/huge_prompts.py [--src TREE] [--prompts 8] [--mb 3.7]

``--src`` serves the trtpipe of another checkout (e.g. an older commit unpacked with ``git archive``) on the same
model, so that before/after run on the same machine. The model is stories260k exported float16 (built into a
temporary directory), the one the twin's tests serve.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
SERVE = "from trtpipe.serving.openai_server import serve; import sys; serve(sys.argv[1], '127.0.0.1', int(sys.argv[2]), 'm')"


def export(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from openai_helpers import fp16_export

    return fp16_export(ROOT / "models" / "stories260k", root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(src: Path, model: Path, prompts: int, mb: float) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(model), str(port)], env=env, cwd=src, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        ps = psutil.Process(proc.pid)
        normal = {"prompt": "Once upon a time", "max_tokens": 8}
        requests.post(url + "/v1/completions", json=normal, timeout=60).raise_for_status()  # warm
        before = ps.memory_info().rss
        peak, done = [before], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], ps.memory_info().rss)
                time.sleep(0.01)

        threading.Thread(target=sample, daemon=True).start()
        rng = random.Random(0)  # varied words: a repeated sentence tokenizes from the tokenizer's cache
        words = [
            " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
            for _ in range(5000)
        ]
        text = "".join(rng.choice(words) for _ in range(int(mb * 2**20 / 5)))[: int(mb * 2**20)]

        def huge(_):
            try:
                r = requests.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2}, timeout=600)
                return f"{r.status_code}: {r.json()['error']['message'][:100]}" if r.status_code != 200 else 200
            except requests.RequestException as exc:
                return type(exc).__name__

        with ThreadPoolExecutor(prompts) as pool:
            futures = [pool.submit(huge, i) for i in range(prompts)]
            time.sleep(0.5)
            t0 = time.perf_counter()
            r = requests.post(url + "/v1/completions", json=normal, timeout=600)
            latency = time.perf_counter() - t0
            statuses = [f.result() for f in futures]
        time.sleep(5)
        done.set()
        after = ps.memory_info().rss
        return {
            "prompts": prompts,
            "prompt_mb": mb,
            "huge_statuses": statuses,
            "normal_status": r.status_code,
            "normal_latency_s": round(latency, 3),
            "rss_before_mb": round(before / 2**20),
            "rss_peak_mb": round(peak[0] / 2**20),
            "rss_after_5s_mb": round(after / 2**20),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=ROOT, help="the checkout whose trtpipe serves (default: this one)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--mb", type=float, default=3.7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = export(Path(tmp))
        print(json.dumps({"src": str(args.src), **run(args.src, model, args.prompts, args.mb)}))


if __name__ == "__main__":
    main()
