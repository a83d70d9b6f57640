"""Leader-mode serving under a real mpiexec: one OS process per rank (rank 0 tritonserver + twin executor,
workers follow), HTTP greedy text equal to transformers, streaming under concurrency, and failure handling with
real kill -9 (every process gone, no /dev/shm file of the job left, the dead rank named).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.errors import ServingError
from trtpipe.triton import mpi_launch
from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.repo import write_repo
from trtpipe.app.launch_triton import repo_info
from trtpipe.supervisor import Ports, free_ports

from triton_helpers import BUILD_CONFIG, like_a_terminal, run_concurrently

pytestmark = [pytest.mark.triton, pytest.mark.mpi, pytest.mark.slow]
TEARDOWN_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache dir of our own: run dirs and detached-server state files stay out of the user's."""
    old = os.environ.get("TRTPIPE_CACHE")
    path = tmp_path_factory.mktemp("cache")
    os.environ["TRTPIPE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TRTPIPE_CACHE")
    else:
        os.environ["TRTPIPE_CACHE"] = old


def _repo(root: Path, stories_dir, recipe, tp: int, pp: int, *overrides) -> Path:
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    ckpt = convert(stories_dir, root / "ckpt", tp=tp, pp=pp, dtype="float16")
    engine = write_twin_engine(ckpt, root / "engine", dict(BUILD_CONFIG))
    write_repo(
        recipe(f"parallel.tp={tp}", f"parallel.pp={pp}", *overrides), engine, engine / "checkpoint", root / "repo"
    )
    return root / "repo"


@pytest.fixture(scope="module")
def repo_tp2(tmp_path_factory, stories_dir, stories_recipe):
    return _repo(tmp_path_factory.mktemp("mpi_tp2"), stories_dir, stories_recipe, 2, 1, "triton.streaming=true")


def job_processes(repo: Path) -> list[str]:
    """Every process whose command line names this repository or its engine (tritonserver, stubs, workers)."""
    marks = (str(repo), str(repo.parent / "engine"))
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z" and any(m in cmd for m in marks) and "pytest" not in cmd:
                found.append(f"{d.name} {cmd[:120]}")
    return found


def shm_left(state: dict, prefix: str) -> list[str]:
    left = [p.name for p in Path("/dev/shm").glob(f"{prefix}*")]
    return left + [n for n in state.get("shm_removed", []) if (Path("/dev/shm") / n).exists()]


def wait_gone(proc, limit: float) -> float:
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < limit:
        time.sleep(0.1)
    return time.monotonic() - t0


READY_LIMIT_S = 600  # start-up of two ranks, each a tritonserver stub or worker importing torch: minutes when loaded


def start(repo: Path, hostfile=None):
    return mpi_launch.start_job(repo, repo_info(repo), "127.0.0.1", Ports(*free_ports(3)), READY_LIMIT_S, hostfile)


def test_tp2_greedy_streaming_and_kill_of_a_worker(cache, repo_tp2, hf_greedy):
    server, state = start(repo_tp2)
    run_dir = server.run_dir
    try:
        ranks = state["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["ok"] for r in ranks)
        pids = {r["pid"] for r in ranks}
        assert len(pids) == 2 and os.getpid() not in pids
        worker = int((run_dir / "rank1.pid").read_text())
        assert worker in pids and "mpi_worker" in Path(f"/proc/{worker}/cmdline").read_text()
        # greedy (gRPC: this repository streams; the tp2 x pp2 test asks over HTTP): transformers' greedy text
        new, expected = hf_greedy("Once upon a time", 40)
        with Client(server.grpc_url) as c:
            assert c.generate("Once upon a time", GenerateOptions(max_tokens=40)) == expected
        # 16 concurrent streaming requests through the in-flight executor on rank 0
        prompts = ["Once upon a time", "Lily wanted to", "Tom had a big red ball.", "One day, a cat saw a bird"]

        def ask(i):
            with Client(server.grpc_url) as c:
                return "".join(c.stream(prompts[i % 4], GenerateOptions(max_tokens=32)))

        results = run_concurrently(ask, 16, timeout=180)
        assert results == {i: hf_greedy(prompts[i % 4], 32)[1] for i in range(16)}
        # kill -9 of the worker rank: the job is torn down and the worker is named
        os.kill(worker, signal.SIGKILL)
        took = wait_gone(server.process, TEARDOWN_LIMIT_S)
        assert server.process.poll() == 1, f"supervisor still running after {took:.1f} s"
        final = json.loads((run_dir / "state.json").read_text())
        assert final["state"] == "failed" and final["error"].startswith(f"rank 1 (worker, pid {worker}) died")
        assert job_processes(repo_tp2) == []
        assert shm_left(final, server.shm_prefix) == []
    finally:
        server.stop()
    # a second serve afterwards works; kill -9 of tritonserver ends it the same way
    server, _ = start(repo_tp2)
    try:
        with Client(server.grpc_url) as c:
            assert c.generate("Once upon a time", GenerateOptions(max_tokens=40)) == expected
        triton = int((server.run_dir / "rank0.pid").read_text())
        os.kill(triton, signal.SIGKILL)
        wait_gone(server.process, TEARDOWN_LIMIT_S)
        final = json.loads((server.run_dir / "state.json").read_text())
        assert final["state"] == "failed" and f"rank 0 (tritonserver, pid {triton})" in final["error"]
        assert job_processes(repo_tp2) == [] and shm_left(final, server.shm_prefix) == []
    finally:
        server.stop()


def test_tp2_pp2_on_two_hosts_then_ctrl_c(cache, tmp_path_factory, stories_dir, stories_recipe, hf_greedy):
    """Four ranks as two 'hosts' (two slot groups, one MPI proxy each) from a hostfile; foreground trtpipe serve
    stops cleanly on Ctrl-C (SIGINT)."""
    repo = _repo(tmp_path_factory.mktemp("mpi_tp2pp2"), stories_dir, stories_recipe, 2, 2)
    hostfile = repo.parent / "hosts"
    hostfile.write_text("127.0.0.1:2\nlocalhost:2\n")
    http = free_ports(1)[0]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "trtpipe"),
            "serve",
            str(repo),
            "--hostfile",
            str(hostfile),
            "--http-port",
            str(http),
            "--timeout",
            str(READY_LIMIT_S),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=like_a_terminal,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C to stop"):
                break
        assert lines and lines[-1].startswith("Ctrl-C"), "".join(lines)
        text = "".join(lines)
        assert "leader mode, 4 ranks" in text and text.count("  rank ") == 4
        run_dir = Path(next(ln.split()[1] for ln in lines if ln.startswith("  run ")))
        hosts = {r["pid"]: r for r in json.loads((run_dir / "ranks.json").read_text())}

        def ppid(pid: int) -> int:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

        # a rank's parent is its wrapper (which records how it ends), the wrapper's parent its host's MPI proxy
        proxies = {ppid(ppid(pid)) for pid in hosts if pid != next(r["pid"] for r in hosts.values() if r["rank"] == 0)}
        assert len(hosts) == 4 and len(proxies) == 2  # ranks 1 | 2, 3: two proxies, one per "host"
        _, expected = hf_greedy("Lily wanted to", 40)
        with Client(f"127.0.0.1:{http}", protocol="http") as c:
            assert c.generate("Lily wanted to", GenerateOptions(max_tokens=40)) == expected
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TEARDOWN_LIMIT_S + 15) == 0
        state = json.loads((run_dir / "state.json").read_text())
        assert state["state"] == "stopped"
        assert job_processes(repo) == []
        assert [n for n in state["shm_removed"] if (Path("/dev/shm") / n).exists()] == []
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)


def test_a_rank_that_cannot_load_fails_the_launch_with_its_error(cache, repo_tp2, tmp_path):
    import shutil

    repo = shutil.copytree(repo_tp2, tmp_path / "repo")  # files copied: the original keeps its rank files
    victim = repo / "tensorrt_llm" / "engine" / "checkpoint" / "rank1.safetensors"
    victim.unlink()
    with pytest.raises(ServingError) as err:
        start(repo)
    assert "rank 1 (" in str(err.value) and f"{victim}: rank file not found" in str(err.value)
    assert "not ready after" not in str(err.value)  # its own error, not the readiness timeout
    assert job_processes(repo) == []
