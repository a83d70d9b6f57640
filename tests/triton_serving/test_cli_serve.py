"""The CLI against real servers: ``serve --detach`` / ``infer`` / ``stop`` on a repository that was
moved after writing (relocatable), and a foreground ``serve`` stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.triton.repo import write_repo
from trtpipe.processes import SHM_DIR

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.fixture(scope="module")
def moved_repo(stories_engine, stories_recipe, tmp_path_factory):
    engine = stories_engine(1)
    root = tmp_path_factory.mktemp("cli")
    write_repo(stories_recipe("triton.streaming=true"), engine, engine / "checkpoint", root / "written")
    shutil.move(root / "written", root / "moved")  # served from elsewhere: nothing may point back
    return root / "moved"


def _run(*args: str) -> str:
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 0, res.output
    return res.output


def test_detach_infer_stream_stop(moved_repo):
    out = _run("serve", str(moved_repo), "--detach")
    pid = int(re.search(r"pid\s+(\d+)", out).group(1))
    try:
        assert "http http://127.0.0.1:" in out  # loopback by default
        answer = _run("infer", "Once upon a time", "--server", str(moved_repo), "--max-tokens", "12")
        assert answer.startswith(", there was a little girl named Lily")
        streamed = _run("infer", "Once upon a time", "--server", str(moved_repo), "--max-tokens", "12", "--stream")
        assert streamed == answer
    finally:
        stopped = _run("stop", str(moved_repo))
    assert f"stopped pid {pid}" in stopped
    assert not [p for p in moved_repo.rglob("*.pyc")]  # serving leaves the repository (a build artifact) unchanged
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not list(SHM_DIR.glob(f"trtpipe*_{pid}_*"))


def test_foreground_serve_stops_cleanly_on_sigterm(moved_repo):
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtpipe.cli", "serve", str(moved_repo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
        grpc = re.search(r"grpc (\S+)", "".join(lines)).group(1)
        answer = _run("infer", "Once upon a time", "--url", grpc, "--max-tokens", "4")
        assert answer.strip() == ", there was a"
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + (rest or "")
    assert "stopped" in rest
    gone = CliRunner().invoke(main, ["infer", "Once upon a time", "--url", grpc, "--max-tokens", "4"])
    assert gone.exit_code == 1 and len(gone.output.strip().splitlines()) == 1, gone.output
    assert f"{grpc.split('://')[-1]}: cannot reach the server" in gone.output  # one line, no traceback


def test_a_failing_start_names_the_cause_and_leaves_nothing(moved_repo, tmp_path):
    from trtpipe.errors import ServingError
    from trtpipe.triton.server_process import start_server

    broken = tmp_path / "broken"
    shutil.copytree(moved_repo, broken)
    (broken / "tensorrt_llm" / "engine" / "checkpoint" / "rank0.safetensors").unlink()
    with pytest.raises(ServingError) as info:
        start_server(broken, timeout=120)
    first = str(info.value).splitlines()[0]
    assert "exited during start-up: failed to load 'tensorrt_llm'" in first and "rank0.safetensors" in first
    assert "log " in first  # the log tail follows
    leftover = subprocess.run(["pgrep", "-f", f"--model-repository={broken}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


def test_repo_command_builds_a_recipe_through_the_pipeline(tmp_path):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "stories-tp2.yaml"
    out = (
        _run(
            "repo",
            str(recipe),
            "--set",
            f"work_dir={tmp_path / 'work'}",
            "--set",
            f"triton.repo_dir={tmp_path / 'exported'}",
        )
        .strip()
        .splitlines()[-1]
    )
    repo = Path(out)
    assert repo == tmp_path / "exported"  # triton.repo_dir: the artifact hardlinked there
    info = json.loads((repo / "trtpipe_repo.json").read_text())
    assert info["twin"] and info["world_size"] == 2
    assert sorted(p.name for p in (repo / "tensorrt_llm" / "engine" / "checkpoint").glob("rank*.safetensors")) == [
        "rank0.safetensors",
        "rank1.safetensors",
    ]
