"""Medusa trees, lookahead decoding and an EAGLE-1 tree on the engine target at tp 2 in leader mode under a real
mpiexec: rank 0 is tritonserver, whose twin ``tensorrt_llm`` model verifies each step's token set over the ranks (the
mask and positions travel with the step, every rank moves the accepted drafts' KV: trtpipe/serving/mpi_engine.py),
the heads drafting on rank 0 from its shard's hidden states; rank 1 a worker. Shown: greedy ensemble text identical
to the plain tp 2 repository's, and the acceptance outputs report drafts verified (how many are accepted is printed,
not asserted). The EAGLE head reads the target's whole lm_head on rank 0 (trtpipe/runtime/distributed.py
``whole_lm_head``); before, its warmup failed in leader mode.

The ranks import trtpipe from their run dir, where the ``cache`` fixture links the package under test.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from test_speculative_mpi_triton import _serve, cache  # noqa: E402, F401  (the fixture links the code under test)
from test_speculative_triton import _llm  # noqa: E402
from trtpipe.triton.client import Client, GenerateOptions  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.mpi, pytest.mark.slow]
PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball."]
MEDUSA_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
EAGLE_TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0]]  # siblings at depths 1 and 2
W, N, G = 4, 3, 4
KINDS = ("medusa_tree", "lookahead", "eagle_tree")


@pytest.fixture(scope="module")
def repos(stories_dir, stories_recipe, tmp_path_factory):
    """name -> a tp 2 Triton repository: plain, and one per kind."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.build_config import resolve_build, to_json
    from trtpipe.engine.eagle_heads import with_eagle_head
    from trtpipe.engine.medusa_heads import with_medusa_heads
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.models.synthetic_heads import fit_eagle1_head, fit_medusa_heads

    root = tmp_path_factory.mktemp("trees_mpi")
    ckpt = convert(stories_dir, root / "ckpt", tp=2, dtype="float32")
    base = ("model.dtype=float32", "parallel.tp=2")
    medusa = fit_medusa_heads(stories_dir, root / "medusa", 4, samples=256, length=48)[0]
    eagle = fit_eagle1_head(stories_dir, root / "eagle1", samples=128)
    recipes = {
        "plain": stories_recipe(*base),
        "medusa_tree": stories_recipe(
            *base,
            "speculative.decoding_type=medusa",
            f"speculative.speculative_model={medusa}",
            f"speculative.max_draft_len={len(MEDUSA_TREE)}",
            "speculative.medusa_choices=" + json.dumps(MEDUSA_TREE).replace(" ", ""),
        ),
        "lookahead": stories_recipe(
            *base,
            "speculative.decoding_type=lookahead_decoding",
            f"speculative.max_window_size={W}",
            f"speculative.max_ngram_size={N}",
            f"speculative.max_verification_set_size={G}",
        ),
        "eagle_tree": stories_recipe(
            *base,
            "speculative.decoding_type=eagle",
            f"speculative.speculative_model={eagle}",
            f"speculative.max_draft_len={len(EAGLE_TREE)}",
            "speculative.eagle_choices=" + json.dumps(EAGLE_TREE).replace(" ", ""),
        ),
    }
    out = {}
    for name, recipe in recipes.items():
        build = dict(BUILD_CONFIG)
        if name == "lookahead":  # --max_draft_len 15 --speculative_decoding_mode lookahead_decoding
            build = to_json(resolve_build(recipe, json.loads((ckpt / "config.json").read_text())).config)
        wrap = with_eagle_head if name == "eagle_tree" else with_medusa_heads
        with wrap(recipe, ckpt, root / f"scratch-{name}") as built_from:
            engine = write_twin_engine(built_from, root / f"engine-{name}", build)
        write_repo(recipe, engine, engine / "checkpoint", root / name)
        out[name] = root / name
    return out


_PLAIN: dict = {}


def _plain_text(repo) -> dict:
    """The plain tp 2 repository's greedy ensemble text of each prompt (served once per module; called inside a test,
    under the ``cache`` fixture's links)."""
    if not _PLAIN:
        server, _ = _serve(repo)
        try:
            with Client(server.grpc_url, model="ensemble") as c:
                _PLAIN.update({p: c.generate(p, GenerateOptions(max_tokens=40)) for p in PROMPTS})
        finally:
            server.stop()
    return _PLAIN


@pytest.mark.parametrize("kind", KINDS)
def test_trees_and_lookahead_at_tp2_in_leader_mode_keep_greedy_text(cache, repos, kind):  # noqa: F811
    want = _plain_text(repos["plain"])
    assert all(len(t) > 40 for t in want.values()), want
    server, state = _serve(repos[kind])
    try:
        assert [r["rank"] for r in state["ranks"]] == [0, 1] and all(r["ok"] for r in state["ranks"])
        with Client(server.grpc_url, model="ensemble") as c:
            for prompt in PROMPTS:
                assert c.generate(prompt, GenerateOptions(max_tokens=40)) == want[prompt], prompt
        drafted = _llm(server, [1, 403, 407, 261, 378], 20, [])  # drafted on rank 0, verified over both ranks
        assert len(drafted["ids"]) == 20 and drafted["total_draft_tokens"] > 0, drafted
        print(
            f"{kind} at tp 2 in leader mode: {drafted['total_accepted_draft_tokens']} of "
            f"{drafted['total_draft_tokens']} drafts accepted over 20 tokens"
        )
        log = (server.run_dir / "rank0.log").read_text()
        assert "reads the target's hidden states" not in log
    finally:
        server.stop()
