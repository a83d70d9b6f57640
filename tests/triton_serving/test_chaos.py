"""Faults against a real tritonserver and real builds: kill -9 of the server under 8 streams, SIGINT/SIGTERM
during serve and build, a full disk (file-size limit) during a build stage."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.pipeline.cache import MARKER
from trtpipe.processes import SHM_DIR
from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.repo import write_repo
from triton_helpers import like_a_terminal, tiny_recipe

pytestmark = [pytest.mark.triton, pytest.mark.slow, pytest.mark.chaos]

PROMPTS = ["Once upon a time", "Lily wanted to", "The cat", "One day, a little boy"]
ERROR_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def streaming_repo(stories_engine, stories_recipe, tmp_path_factory):
    engine = stories_engine(1)
    repo = tmp_path_factory.mktemp("chaos") / "repo"
    write_repo(stories_recipe("triton.streaming=true"), engine, engine / "checkpoint", repo)
    return repo


def _serve_foreground(repo: Path):
    """`trtpipe serve REPO` in the foreground; returns (process, grpc url, tritonserver pid) once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtpipe.cli", "serve", str(repo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=like_a_terminal,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C to stop" in line:
            break
    out = "".join(lines)
    assert "Ctrl-C to stop" in out, out + proc.stderr.read()
    (server,) = [p for p in psutil.Process(proc.pid).children() if p.name() == "tritonserver"]
    return proc, re.search(r"grpc (\S+)", out).group(1), server.pid


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def _streams(url: str, n: int, max_tokens: int):
    """n streaming requests in threads; returns (threads, first piece events, outcomes [(what, time)])."""
    started = [threading.Event() for _ in range(n)]
    outcome: list = [None] * n

    def run(i):
        try:
            with Client(url) as c:
                for _ in c.stream(PROMPTS[i % len(PROMPTS)], GenerateOptions(max_tokens=max_tokens)):
                    started[i].set()
            outcome[i] = ("finished", time.monotonic())
        except Exception as exc:  # what a client sees when the server dies
            outcome[i] = (f"{type(exc).__name__}: {exc}", time.monotonic())
        started[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, started, outcome


def _cleanup(proc: subprocess.Popen, server_pid: int) -> None:
    """After a failed check: stop the serve CLI and its tritonserver (its own session: killing the CLI leaves it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # serve stops its server on Ctrl-C
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if psutil.pid_exists(server_pid):
        try:
            os.killpg(server_pid, signal.SIGKILL)
        except OSError:
            pass


def _first_piece(started: list, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(e.is_set() for e in started):
        assert time.monotonic() < deadline, "no stream started"
        time.sleep(0.01)


def _gone(pid: int, repo: Path, timeout: float = 15.0) -> list:
    """Processes still alive (the server, or python stubs serving ``repo``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = [
            p
            for p in psutil.process_iter(["pid", "cmdline"])
            if p.info["pid"] == pid or str(repo) in " ".join(p.info["cmdline"] or [])
        ]
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_kill9_of_tritonserver_under_8_streams(streaming_repo):
    proc, url, server_pid = _serve_foreground(streaming_repo)
    try:
        listening = [c.laddr.ip for c in psutil.Process(server_pid).net_connections("inet") if c.status == "LISTEN"]
        assert listening and all(_loopback(ip) for ip in listening), listening  # loopback only, by default
        threads, started, outcome = _streams(url, 8, max_tokens=480)
        _first_piece(started)  # every request is in flight (streaming or queued) when the server dies
        killed = time.monotonic()
        os.kill(server_pid, signal.SIGKILL)
        for t in threads:
            t.join(ERROR_WITHIN_S + 10)
        assert not any(t.is_alive() for t in threads), "a client hangs after the server died"
        delays = [when - killed for _, when in outcome]
        print(
            f"kill -9: clients saw errors {min(delays):.2f}-{max(delays):.2f} s after the kill: "
            + "; ".join(sorted({what.split(":")[0] for what, _ in outcome}))
        )
        assert all(what.startswith("ServingError: ") and "\n" not in what for what, _ in outcome), outcome
        assert max(delays) <= ERROR_WITHIN_S, outcome
        _, err = proc.communicate(timeout=60)
    finally:
        _cleanup(proc, server_pid)
    assert proc.returncode not in (0, None)
    assert f"tritonserver (pid {server_pid}) was killed by SIGKILL" in err.strip().splitlines()[0], err
    assert not _gone(server_pid, streaming_repo), "processes of the dead server are left"
    assert not list(SHM_DIR.glob(f"trtpipe*_{server_pid}_*"))
    # a new serve of the same repository works
    res = CliRunner().invoke(main, ["serve", str(streaming_repo), "--detach"])
    assert res.exit_code == 0, res.output
    try:
        answer = CliRunner().invoke(
            main, ["infer", "Once upon a time", "--server", str(streaming_repo), "--max-tokens", "4"]
        )
        assert answer.exit_code == 0 and answer.output.strip() == ", there was a", answer.output
    finally:
        assert CliRunner().invoke(main, ["stop", str(streaming_repo)]).exit_code == 0


def test_sigint_of_a_foreground_serve_with_streams_in_flight(streaming_repo):
    proc, url, server_pid = _serve_foreground(streaming_repo)
    try:
        threads, started, outcome = _streams(url, 2, max_tokens=480)
        _first_piece(started)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        for t in threads:
            t.join(ERROR_WITHIN_S + 10)
    finally:
        _cleanup(proc, server_pid)
    assert proc.returncode == 0 and "stopped" in out, (out, err)
    assert not any(t.is_alive() for t in threads)
    assert not _gone(server_pid, streaming_repo)
    assert not list(SHM_DIR.glob(f"trtpipe*_{server_pid}_*"))


# --- builds ------------------------------------------------------------------------------------------------


def _artifacts(work: Path) -> dict[str, str]:
    """sha256 of every artifact file (stage/key/path), the markers (with timestamps) left out."""
    return {
        p.relative_to(work / "artifacts").as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((work / "artifacts").rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _build(recipe: Path, limit_bytes: int | None = None, signal_at: str | None = None, sig=signal.SIGTERM):
    """`trtpipe build` in a child; optionally under a file-size limit, or signalled once ``signal_at`` shows."""

    def limits():
        like_a_terminal()
        if limit_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    proc = subprocess.Popen(
        [sys.executable, "-m", "trtpipe.cli", "build", str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limits,
    )
    err, signalled = [], None
    if signal_at:
        for line in proc.stderr:
            err.append(line)
            if signal_at in line:
                proc.send_signal(sig)
                signalled = time.monotonic()
                break
    out, rest = proc.communicate(timeout=600)
    if signalled is not None:
        print(
            f"{signal.Signals(sig).name} during build: exit {proc.returncode} "
            f"{time.monotonic() - signalled:.2f} s after the signal"
        )
    return proc.returncode, out, "".join(err) + rest


def _no_partial_folders(work: Path) -> None:
    hidden = [p for p in (work / "artifacts").glob("*/.*")]
    assert not hidden, [(p, sorted(q.relative_to(p).as_posix() for q in p.rglob("*"))) for p in hidden]


def test_build_interrupted_or_out_of_space_then_resumed_gives_identical_artifacts(stories_dir, tmp_path):
    # artifacts quote the recipe path and the work dir (notes for the reader): the reference is built there too
    recipe, work = tmp_path / "chaos.yaml", tmp_path / "work"
    recipe.write_text(tiny_recipe("chaos", work=work, model=stories_dir))
    assert _build(recipe)[0] == 0
    reference = _artifacts(work)
    shutil.rmtree(work)

    code, _, err = _build(recipe, limit_bytes=200_000)  # the fp16 rank file is ~0.5 MB: the checkpoint fails
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("stage checkpoint failed: file size limit reached writing "), err
    assert re.search(r"writing \S+/rank0\.safetensors \(File too large\)", last), last
    assert not [p for p in (work / "artifacts" / "checkpoint").iterdir()]  # nothing half-written kept
    assert json.loads((work / "manifest.json").read_text())["status"] == "failed"

    for sig in (signal.SIGTERM, signal.SIGINT):
        code, _, err = _build(recipe, signal_at="running", sig=sig)
        assert code == 130 and err.strip().splitlines()[-1] == "interrupted", err
        _no_partial_folders(work)
        assert json.loads((work / "manifest.json").read_text())["status"] == "interrupted"

    code, _, err = _build(recipe)  # the lock was released; everything runs again
    assert code == 0, err
    assert _artifacts(work) == reference
    _no_partial_folders(work)


def test_a_dead_executor_stops_the_server_so_readiness_fails(streaming_repo, monkeypatch):
    """The twin's executor loop ends for real (step 6 raises SystemExit in the stub's executor thread, as
    TRTPIPE_TWIN_FAULT asks): the request in flight gets the error, the stub stops its tritonserver (which alone
    would stay ready), and ``trtpipe serve`` exits non-zero naming why; nothing of the deployment is left."""
    import tritonclient.grpc as grpcclient

    from trtpipe.triton.executor_guard import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "exit-at-step:6")
    proc, url, server_pid = _serve_foreground(streaming_repo)
    try:
        with grpcclient.InferenceServerClient(url) as raw:
            assert raw.is_server_ready()
        with pytest.raises(Exception, match="the executor loop died: SystemExit"):
            with Client(url) as c:
                c.generate("Once upon a time", GenerateOptions(max_tokens=40, end_id=-1))
        proc.wait(120)  # before the guard, tritonserver kept serving (and answering ready) until killed
        err = proc.stderr.read()
        assert proc.returncode != 0, err
        assert "the executor loop died: SystemExit: TRTPIPE_TWIN_FAULT: exit at step 6" in err, err[-2000:]
        assert not _gone(server_pid, streaming_repo), "tritonserver or a stub outlived the deployment"
    finally:
        _cleanup(proc, server_pid)
