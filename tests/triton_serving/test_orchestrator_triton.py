"""The CPU twin in orchestrator mode (``TRTLLM_ORCHESTRATOR=1``, what ``launch_triton_server.py --multi-model`` sets):
one real tritonserver serves the two-model form (BLS ``tensorrt_llm_draft_model_name``) at tp 2, and each
``tensorrt_llm`` model instance, the target and the draft, starts its own MPI world of rank workers under mpiexec and
drives it from its stub (trtpipe/serving/orchestrator_world.py), as upstream's orchestrator spawns each instance's
executor workers.

Both repositories are built by the pipeline at ``parallel.tp=2`` (stories260k float32; the two-model one with the model
as its own draft). Shown: each model's world runs (its rank workers are the server's descendants); greedy BLS text with
``num_draft_tokens`` 3 equals the plain tp 2 repository's (served in the one-process twin) over a prompt set, every
draft accepted, 20 tokens draft and accept 15 (the hand trace of tests/triton_serving/test_speculative_triton.py); after
the server stops none of its processes is left.

The stubs import trtpipe from their working directory (the cache's log dir): this test links the package under test
there, so the code that runs is this checkout's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

import trtpipe  # noqa: E402
from trtpipe.processes import pid_alive  # noqa: E402
from trtpipe.triton import server_process  # noqa: E402
from trtpipe.triton.mpi_launch import descendants  # noqa: E402

from test_speculative_triton import K, PROMPTS, bls, build_repo, rounds, speculative  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.mpi, pytest.mark.slow]
READY_LIMIT_S = 600


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("cache")
    (root / "logs").mkdir()
    (root / "logs" / "trtpipe").symlink_to(Path(trtpipe.__file__).resolve().parent)
    monkeypatch.setenv("TRTPIPE_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def repos(stories_dir, tmp_path_factory):
    plain = build_repo(tmp_path_factory.mktemp("plain_tp2"), stories_dir, "parallel.tp=2")
    spec = build_repo(tmp_path_factory.mktemp("spec_tp2"), stories_dir, "parallel.tp=2", *speculative(stories_dir))
    return plain, spec


def _cmdlines(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def test_two_model_form_at_tp2_in_orchestrator_mode(cache, repos, monkeypatch):
    plain_repo, spec_repo = repos
    server = server_process.start_server(plain_repo, timeout=READY_LIMIT_S)  # the one-process twin at tp 2
    try:
        want = {p: bls(server, p, 40)["text_output"] for p in PROMPTS}
    finally:
        server.stop()
    assert all(len(t) > 40 for t in want.values()), want

    monkeypatch.setenv("TRTLLM_ORCHESTRATOR", "1")
    monkeypatch.setenv("TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES", "1")
    server = server_process.start_server(spec_repo, timeout=READY_LIMIT_S)
    try:
        tree = _cmdlines(descendants(server.pid))
        launchers = [c for c in tree.values() if "/mpiexec " in c]
        leaders = [c for c in tree.values() if "trtpipe.serving.orchestrator_world" in c and "mpiexec" not in c]
        workers = [c for c in tree.values() if "trtpipe.serving.mpi_worker" in c and "mpiexec" not in c]
        assert len(launchers) == 2, tree  # one world per tensorrt_llm model instance: the target's and the draft's
        assert len(leaders) == 2 and len(workers) == 2, tree
        assert sum("tensorrt_llm_draft/engine" in c for c in workers) == 1, workers
        for prompt in PROMPTS:
            got = bls(server, prompt, 40, num_draft_tokens=K)
            assert got.get("text_output") == want[prompt], (prompt, got)
            assert float(got["acceptance_rate"].reshape(-1)[0]) == 1.0  # the model as its own draft
        drafts, _ = rounds(20, K)
        got = bls(server, PROMPTS[0], 20, num_draft_tokens=K)
        assert int(got["total_draft_tokens"].reshape(-1)[0]) == drafts == 15
        assert int(got["total_accepted_draft_tokens"].reshape(-1)[0]) == 15
        pids = list(tree)
    finally:
        server.stop()
    left = {pid: c for pid, c in _cmdlines(pids).items() if pid_alive(pid)}
    assert not left, left  # no rank, launcher or stub outlives the server


def test_orchestrator_mode_without_spawned_workers_is_refused_in_one_line(stories_engine, monkeypatch):
    """``--disable-spawn-processes`` (ranks placed by ``participant_ids``) is not what the twin runs: one line naming
    the key, before anything starts (upstream's python backend refuses it too)."""
    from trtpipe.serving import orchestrator_world

    engine = stories_engine(2)
    assert orchestrator_world.world_of(engine) == 2
    monkeypatch.setenv("TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES", "0")
    with pytest.raises(RuntimeError, match=r"^TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=0 \(--disable-spawn-processes"):
        orchestrator_world.World(engine, "tensorrt_llm")


def test_dry_run_of_the_twin_repository_shows_both_launches(repos):
    """``serve --dry-run`` of the two-model twin repository at tp 2: the TensorRT-engine launch it stands for is
    orchestrator mode (draft and target each on GPUs of their own), and the twin's own launch is orchestrator mode
    too (one tritonserver, the environment test_two_model_form_at_tp2_in_orchestrator_mode serves under); the plain
    tp 2 repository stays in leader mode."""
    import shlex

    from trtpipe.app.launch_triton import dry_run_lines
    from trtpipe.supervisor import Ports

    lines = dry_run_lines(repos[1], (), "127.0.0.1", Ports(8000, 8001, 8002), "/opt/tritonserver/bin/tritonserver")
    assert "orchestrator mode runs: world_size 2" in lines[0]
    trt = shlex.split(lines[1].removeprefix("#   "))
    assert trt[:7] == ["env", "TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1", "mpirun"] + [
        "--allow-run-as-root",
        "-n",
        "1",
    ]
    assert [a for a in trt if a.startswith("--cuda-memory-pool-byte-size=")] == [
        f"--cuda-memory-pool-byte-size={j}:0" for j in range(4)
    ]
    # the twin runs the same mode: `trtpipe serve` starts one tritonserver with upstream's orchestrator environment
    assert "CPU twin, orchestrator mode" in lines[2]
    twin = shlex.split(lines[-1])
    assert twin[:3] == ["env", "TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1"]
    assert twin[3].endswith("/bin/tritonserver") and "mpiexec" not in twin
    plain = dry_run_lines(repos[0], (), "127.0.0.1", Ports(8000, 8001, 8002), "/opt/tritonserver/bin/tritonserver")
    assert "leader mode" in "\n".join(plain) and "TRTLLM_ORCHESTRATOR" not in "\n".join(plain)
