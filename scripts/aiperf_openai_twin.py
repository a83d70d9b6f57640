"""NVIDIA AIPerf (``completions`` and ``chat`` endpoint types, streaming) against the OpenAI-compatible twin.

Starts ``trtpipe serve-openai TARGET`` on a free 127.0.0.1 port, runs ``aiperf profile`` once per endpoint type,
prints the request count, error count, throughput and TTFT/latency percentiles from AIPerf's own export, and stops
the server. AIPerf lives in its own venv (it needs numpy 2; ``scripts/install_aiperf.sh`` of the bench work makes
``.venv-aiperf``): pass its binary with ``--aiperf`` or ``$TRTPIPE_AIPERF``.

    python scripts/aiperf_openai_twin.py recipes/stories-llmapi-fp8.yaml --aiperf .venv-aiperf/bin/aiperf \
        --chat-template tests/export/data/chat_template.jinja --requests 40 --concurrency 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"server not ready after {timeout:.0f} s")


def summary(out_dir: Path) -> dict:
    """Request/error counts and a few metrics from AIPerf's JSON export (searched, the layout varies by release)."""
    found = sorted(out_dir.rglob("profile_export_aiperf.json"))
    if not found:
        raise SystemExit(f"no profile_export_aiperf.json under {out_dir}")
    data = json.loads(found[0].read_text())
    records = sorted(out_dir.rglob("profile_export.jsonl"))
    errors = ok = 0
    for path in records:
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            errors += bool(rec.get("error"))
            ok += not rec.get("error")
    def metric(name, stat):
        m = data.get(name) or (data.get("records") or {}).get(name) or {}
        return m.get(stat)
    return {"requests_ok": ok, "errors": errors,
            "request_throughput_per_s": metric("request_throughput", "avg"),
            "output_token_throughput_per_s": metric("output_token_throughput", "avg"),
            "ttft_ms_p50": metric("time_to_first_token", "p50"), "ttft_ms_p99": metric("time_to_first_token", "p99"),
            "latency_ms_p50": metric("request_latency", "p50"), "latency_ms_p99": metric("request_latency", "p99")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="llmapi recipe or HF model directory")
    ap.add_argument("--aiperf", default=os.environ.get("TRTPIPE_AIPERF", ".venv-aiperf/bin/aiperf"))
    ap.add_argument("--chat-template")
    ap.add_argument("--tokenizer", help="tokenizer dir for AIPerf (default: the model dir / recipe model.source)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--isl", type=int, default=32)
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    port = free_port()
    trtpipe = Path(sys.executable).parent / "trtpipe"
    cmd = [str(trtpipe), "serve-openai", a.target, "--port", str(port), "--served-model-name", "twin"]
    if a.chat_template:
        cmd += ["--chat-template", a.chat_template]
    tokenizer = a.tokenizer
    if tokenizer is None:
        if Path(a.target).is_dir():
            tokenizer = a.target
        else:
            import yaml

            src = yaml.safe_load(Path(a.target).read_text())["model"]["source"]
            tokenizer = str((Path(a.target).parent / src).resolve())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        wait_ready(url, proc, a.timeout)
        for endpoint in ("completions", "chat"):
            with tempfile.TemporaryDirectory(prefix=f"aiperf-{endpoint}-") as tmp:
                run = [a.aiperf, "profile", "--model", "twin", "--url", url, "--endpoint-type", endpoint,
                       "--streaming", "--tokenizer", tokenizer, "--isl", str(a.isl), "--osl", str(a.osl),
                       "--request-count", str(a.requests), "--concurrency", str(a.concurrency),
                       "--random-seed", "0", "--ui", "none", "--artifact-dir", tmp, "--export-level", "records",
                       "--no-gpu-telemetry", "--no-server-metrics"]
                t0 = time.perf_counter()
                p = subprocess.run(run, capture_output=True, text=True, timeout=a.timeout)
                if p.returncode != 0:
                    print(p.stdout[-3000:], p.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"aiperf {endpoint}: exit {p.returncode}")
                results[endpoint] = dict(summary(Path(tmp)), wall_s=round(time.perf_counter() - t0, 1))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(json.dumps(results, indent=2))
    if any(r["errors"] for r in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
