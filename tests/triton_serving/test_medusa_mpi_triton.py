"""Medusa on the engine target at tp 2 in leader mode under a real mpiexec: rank 0 is tritonserver, whose twin
``tensorrt_llm`` model keeps the target's hidden states from its shard's forward (trtpipe/serving/mpi_engine.py
``RankEngine.captures_hidden_states``) and drafts with the heads of the engine's checkpoint; rank 1 a worker. Before,
the heads refused an mpirun target. Shown: greedy ensemble text identical to the plain tp 2 repository's, and the
acceptance outputs report drafts (random heads: acceptance is measured, not asserted).
"""

from __future__ import annotations

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from test_speculative_mpi_triton import _serve, cache  # noqa: E402, F401  (the fixture links the code under test)
from test_speculative_triton import _llm  # noqa: E402
from trtpipe.triton.client import Client, GenerateOptions  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.mpi, pytest.mark.slow]
K = 3
PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball."]


@pytest.fixture(scope="module")
def repos(stories_dir, stories_recipe, tmp_path_factory):
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.medusa_heads import with_medusa_heads
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.models.synthetic_heads import make_medusa_heads

    root = tmp_path_factory.mktemp("medusa_mpi")
    heads = make_medusa_heads(stories_dir, root / "heads", num_heads=4, seed=3)
    ckpt = convert(stories_dir, root / "ckpt", tp=2, dtype="float32")
    base = ("model.dtype=float32", "parallel.tp=2")
    spec = (
        "speculative.decoding_type=medusa",
        f"speculative.speculative_model={heads}",
        f"speculative.max_draft_len={K}",
    )
    plain_engine = write_twin_engine(ckpt, root / "engine", dict(BUILD_CONFIG))
    recipe = stories_recipe(*base, *spec)
    with with_medusa_heads(recipe, ckpt, root) as built_from:
        medusa_engine = write_twin_engine(built_from, root / "engine-medusa", dict(BUILD_CONFIG))
    write_repo(stories_recipe(*base), plain_engine, plain_engine / "checkpoint", root / "plain")
    write_repo(recipe, medusa_engine, medusa_engine / "checkpoint", root / "spec")
    return root / "plain", root / "spec"


def test_medusa_at_tp2_in_leader_mode_keeps_greedy_text(cache, repos):  # noqa: F811
    plain_repo, spec_repo = repos
    opts = GenerateOptions(max_tokens=40)
    server, _ = _serve(plain_repo)
    try:
        with Client(server.grpc_url, model="ensemble") as c:
            want = {p: c.generate(p, opts) for p in PROMPTS}
    finally:
        server.stop()
    assert all(len(t) > 40 for t in want.values()), want
    server, state = _serve(spec_repo)
    try:
        assert [r["rank"] for r in state["ranks"]] == [0, 1] and all(r["ok"] for r in state["ranks"])
        with Client(server.grpc_url, model="ensemble") as c:
            for prompt in PROMPTS:
                assert c.generate(prompt, opts) == want[prompt], prompt
        drafted = _llm(server, [1, 403, 407, 261, 378], 20, [])  # the heads drafted on rank 0
        assert drafted["total_draft_tokens"] > 0 and len(drafted["ids"]) == 20, drafted
        log = (server.run_dir / "rank0.log").read_text()
        assert "reads the target's hidden states" not in log
    finally:
        server.stop()
