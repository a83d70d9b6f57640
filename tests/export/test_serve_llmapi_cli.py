"""``trtpipe serve`` and ``trtpipe stop`` serve any target: a ``target: llmapi`` recipe runs on the OpenAI twin
of trtllm-serve, detached, answers the official ``openai`` client, and ``trtpipe stop RECIPE`` ends it, leaving
neither a process nor a state file behind. Real processes, real HTTP on 127.0.0.1, the committed recipe."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "stories-llmapi-fp8.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trtpipe(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=900
    )


def test_serve_detach_an_llmapi_recipe_then_stop_it(tmp_path, stories_dir):
    from openai import OpenAI

    from trtpipe.processes import pid_alive

    env = {**os.environ, "TRTPIPE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    sets = [
        "--set",
        f"work_dir={tmp_path / 'work'}",
        "--set",
        f"model.source={stories_dir}",
        "--set",
        "quantization.calibration.num_samples=4",
        "--set",
        "accuracy.num_samples=2",
    ]
    port = free_port()
    started = trtpipe("serve", str(RECIPE), *sets, "--http-port", str(port), "--detach", env=env)
    assert started.returncode == 0, started.stderr[-3000:]
    pid = int(re.search(r"pid\s+(\d+) \(trtpipe stop ", started.stdout).group(1))
    assert f"http http://127.0.0.1:{port}/v1" in started.stdout
    state_files = list((tmp_path / "cache" / "servers").glob("*.json"))
    try:
        assert [json.loads(p.read_text())["kind"] for p in state_files] == ["openai"]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(
            model="stories-llmapi-fp8", prompt="Once upon a time", max_tokens=8, temperature=0
        )
        assert out.choices[0].text and 0 < out.usage.completion_tokens <= 8
    finally:
        stopped = trtpipe("stop", str(RECIPE), *sets, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"stopped pid {pid} (")
    assert not pid_alive(pid)  # stop returns once the process is gone (a zombie counts as gone)
    assert not any(p.exists() for p in state_files)
    again = trtpipe("stop", str(RECIPE), *sets, env=env)
    assert again.returncode == 0 and again.stdout.startswith("no detached server is running")
