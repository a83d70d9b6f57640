"""A real Prometheus for the end-to-end monitoring tests: started on a free port (a new port when another process
took the one picked before Prometheus bound it), ready before the test queries it, stopped afterwards."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

BIND_TRIES = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def poll(what: str, fn, deadline_s: float = 180.0, step_s: float = 0.5):
    """Call ``fn`` until it returns something truthy; fail naming ``what`` at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(step_s)
    pytest.fail(f"timed out waiting for {what}")


def query(api: str, q: str):
    """The result rows of an instant query (None while Prometheus is not answering)."""
    try:
        return get(f"{api}/query?query={urllib.parse.quote(q)}")["data"]["result"]
    except OSError:
        return None


def _ready(base: str, proc: subprocess.Popen) -> str:
    """'ready', 'exited' or '' (still starting)."""
    if proc.poll() is not None:
        return "exited"
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as r:
            return "ready" if r.status == 200 else ""
    except OSError:
        return ""


@contextlib.contextmanager
def prometheus(mon_dir: Path, work: Path):
    """Run Prometheus on ``mon_dir/prometheus.yml``; yields its API base URL (``http://127.0.0.1:P/api/v1``)."""
    for attempt in range(BIND_TRIES):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log_path = work / f"prometheus-{attempt}.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={mon_dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / f'tsdb-{attempt}'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=mon_dir,
            )
        state = poll("Prometheus ready", lambda: _ready(base, proc), deadline_s=120)
        if state == "ready":
            break
        text = log_path.read_text()
        if "address already in use" not in text:
            pytest.fail(f"prometheus exited with {proc.returncode}: {text[-2000:]}")
    else:
        pytest.fail(f"prometheus found no free port in {BIND_TRIES} tries")
    try:
        yield f"{base}/api/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
