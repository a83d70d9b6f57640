"""The two-model draft-target form (BLS ``tensorrt_llm_draft_model_name``, tensorrtllm_backend's
``examples/draft_target_model/README.md@567239fc``) served at tp 2 in leader mode under a real mpiexec: rank 0 is
tritonserver, rank 1 an MPI worker holding its shard of the target and of the draft (trtpipe/serving/draft_proxy.py:
the draft's stub runs on the ranks through the target's stub).

Both repositories are built by the pipeline at ``parallel.tp=2`` (stories260k float32; the two-model one with the
model as its own draft). Shown: the worker rank loads the draft's shard; greedy BLS text with ``num_draft_tokens`` 3
equals the text of the plain tp 2 repository over a prompt set, and every draft is accepted; 20 tokens draft 15 and
accept 15 (the hand trace of tests/triton_serving/test_speculative_triton.py).

The ranks import trtpipe from their working directory, the run dir, where this test links the package under test: the
code that runs is this checkout's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

import trtpipe  # noqa: E402
from trtpipe.app.launch_triton import repo_info  # noqa: E402
from trtpipe.supervisor import Ports, free_ports  # noqa: E402
from trtpipe.triton import mpi_launch  # noqa: E402

from test_speculative_triton import K, PROMPTS, bls, build_repo, rounds, speculative  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.mpi, pytest.mark.slow]
READY_LIMIT_S = 600


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    """A cache of our own; each run dir gets a ``trtpipe`` link to the package under test: the leader-mode ranks (rank
    0's stubs, the workers) run there and import trtpipe from it, not from the editable install."""
    monkeypatch.setenv("TRTPIPE_CACHE", str(tmp_path_factory.mktemp("cache")))
    made = mpi_launch.run_dir_for

    def linked(repo):
        run_dir = made(repo)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "trtpipe").symlink_to(Path(trtpipe.__file__).resolve().parent)
        return run_dir

    monkeypatch.setattr(mpi_launch, "run_dir_for", linked)


@pytest.fixture(scope="module")
def repos(stories_dir, tmp_path_factory):
    plain = build_repo(tmp_path_factory.mktemp("plain_tp2"), stories_dir, "parallel.tp=2")
    spec = build_repo(tmp_path_factory.mktemp("spec_tp2"), stories_dir, "parallel.tp=2", *speculative(stories_dir))
    return plain, spec


def _serve(repo: Path):
    return mpi_launch.start_job(repo, repo_info(repo), "127.0.0.1", Ports(*free_ports(3)), READY_LIMIT_S)


def test_two_model_form_at_tp2_in_leader_mode_keeps_greedy_text(cache, repos):
    plain_repo, spec_repo = repos
    assert repo_info(spec_repo)["world_size"] == 2
    server, _ = _serve(plain_repo)
    try:
        want = {p: bls(server, p, 40)["text_output"] for p in PROMPTS}
    finally:
        server.stop()
    assert all(len(t) > 40 for t in want.values()), want
    server, state = _serve(spec_repo)
    try:
        assert [r["rank"] for r in state["ranks"]] == [0, 1] and all(r["ok"] for r in state["ranks"])
        worker = int((server.run_dir / "rank1.pid").read_text())
        argv = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
        assert b"--draft" in argv  # the worker rank holds its shard of the draft too
        for prompt in PROMPTS:
            got = bls(server, prompt, 40, num_draft_tokens=K)
            assert got.get("text_output") == want[prompt], (prompt, got)
            assert float(got["acceptance_rate"].reshape(-1)[0]) == 1.0  # the model as its own draft
        drafts, _ = rounds(20, K)
        got = bls(server, PROMPTS[0], 20, num_draft_tokens=K)
        assert int(got["total_draft_tokens"].reshape(-1)[0]) == drafts == 15
        assert int(got["total_accepted_draft_tokens"].reshape(-1)[0]) == 15
        assert "draft model on the ranks" not in (server.run_dir / "rank0.log").read_text()
    finally:
        server.stop()
