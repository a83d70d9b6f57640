"""Huge prompts against the OpenAI twin or Triton (issue 38, item 4): N prompts of M MB each at once, and one normal
request sent beside them. Prints the server's RSS (before, peak, 5 s after; for Triton, tritonserver and its python
stubs together) and the normal request's latency, as JSON.

    python scripts/huge_prompts.py [--front openai|triton] [--src TREE] [--prompts 8] [--mb 3.7]

``--src`` serves the trtpipe of another checkout (e.g. an older commit unpacked with ``git archive``) on the same
model, so that before/after run on the same machine. The model is stories260k: for the OpenAI twin exported
float16, for Triton its CPU twin engine (float16, the Triton tests' limits: max_input_len 256) in a repository
written by that checkout from ``recipes/stories-fp16.yaml``; every request goes to the ensemble through
HTTP ``generate``.
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


def huge_text(mb: float) -> str:
    """``mb`` MB of varied words: a repeated sentence would tokenize from the tokenizer's cache."""
    rng = random.Random(0)
    words = [
        " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(5000)
    ]
    return "".join(rng.choice(words) for _ in range(int(mb * 2**20 / 5)))[: int(mb * 2**20)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(url: str, normal: dict, huge_body, error_of, rss, prompts: int, mb: float) -> dict:
    """One front's numbers: warm it with ``normal``, send ``prompts`` huge prompts (``huge_body(text)``) at once
    and, 0.5 s later, one ``normal`` request; RSS (``rss()``) sampled every 10 ms for the peak, and 5 s after."""
    requests.post(url, json=normal, timeout=60).raise_for_status()  # warm
    before = rss()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    text = huge_text(mb)

    def huge(_):
        try:
            r = requests.post(url, json=huge_body(text), timeout=600)
            return f"{r.status_code}: {error_of(r)[:100]}" if r.status_code != 200 else 200
        except requests.RequestException as exc:
            return type(exc).__name__

    with ThreadPoolExecutor(prompts) as pool:
        futures = [pool.submit(huge, i) for i in range(prompts)]
        time.sleep(0.5)
        t0 = time.perf_counter()
        r = requests.post(url, json=normal, timeout=600)
        latency = time.perf_counter() - t0
        statuses = [f.result() for f in futures]
    time.sleep(5)
    done.set()
    after = rss()
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
        return measure(
            url + "/v1/completions",
            {"prompt": "Once upon a time", "max_tokens": 8},
            lambda text: {"prompt": text, "max_tokens": 2},
            lambda r: r.json()["error"]["message"],
            lambda: ps.memory_info().rss,
            prompts,
            mb,
        )
    finally:
        proc.terminate()
        proc.wait(30)


WRITE_REPO = """
import sys
from pathlib import Path
src, model, root = (Path(a) for a in sys.argv[1:4])
sys.path.insert(0, str(src / "tests" / "triton_serving"))
from triton_helpers import BUILD_CONFIG
from trtpipe.app.validation import load_recipe
from trtpipe.checkpoint.convert import convert
from trtpipe.engine.twin_engine_dir import write_twin_engine
from trtpipe.triton.repo import write_repo
engine = write_twin_engine(convert(model, root / "ckpt", tp=1, dtype="float16"), root / "engine", dict(BUILD_CONFIG))
write_repo(load_recipe(src / "recipes" / "stories-fp16.yaml", []), engine, engine / "checkpoint", root / "repo")
"""


def serve_triton(src: Path, root: Path) -> tuple[subprocess.Popen, str]:
    """``trtpipe serve`` of ``src`` on a repository that ``src`` writes; returns (process, http url) once ready.

    The python stubs' embedded interpreter ignores PYTHONPATH (its sys.path is the venv's, where an editable
    install may point at another checkout), but looks first in its working directory, which is tritonserver's:
    the log directory under ``$TRTPIPE_CACHE``. So each checkout gets a cache of its own whose ``logs/trtpipe``
    is that checkout's package."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "TRTPIPE_CACHE": str(root / "cache")}
    subprocess.run(
        [sys.executable, "-c", WRITE_REPO, str(src), str(ROOT / "models" / "stories260k"), str(root)],
        env=env,
        cwd=src,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    (root / "cache" / "logs").mkdir(parents=True)
    (root / "cache" / "logs" / "trtpipe").symlink_to(src / "trtpipe")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtpipe.cli", "serve", str(root / "repo")],
        env=env,
        cwd=src,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C to stop" in line:
            return proc, next(ln.split()[1] for ln in lines if ln.strip().startswith("http "))
    raise SystemExit("trtpipe serve ended before it was ready:\n" + "".join(lines))


def server_rss(ps: psutil.Process) -> int:
    """RSS of a process and all its descendants (tritonserver and its python stubs)."""
    total = 0
    for p in [ps, *ps.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_triton(src: Path, root: Path, prompts: int, mb: float) -> dict:
    proc, url = serve_triton(src, root)
    generate = url + "/v2/models/ensemble/generate"
    try:
        (server,) = [p for p in psutil.Process(proc.pid).children() if p.name() == "tritonserver"]
        return measure(
            generate,
            {"text_input": "Once upon a time", "max_tokens": 8},
            lambda text: {"text_input": text, "max_tokens": 2},
            lambda r: r.json().get("error", ""),
            lambda: server_rss(server),
            prompts,
            mb,
        )
    finally:
        proc.send_signal(signal.SIGINT)  # serve stops its tritonserver on Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--front", choices=("openai", "triton"), default="openai")
    ap.add_argument("--src", type=Path, default=ROOT, help="the checkout whose trtpipe serves (default: this one)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--mb", type=float, default=3.7)
    args = ap.parse_args()
    src = args.src.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        if args.front == "triton":
            result = run_triton(src, Path(tmp), args.prompts, args.mb)
        else:
            result = run(src, export(Path(tmp)), args.prompts, args.mb)
        print(json.dumps({"front": args.front, "src": str(src), **result}))


if __name__ == "__main__":
    main()
