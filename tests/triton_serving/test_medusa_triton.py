"""Medusa served by a real tritonserver through the CPU twin (engine target).

The recipe's ``speculative: {decoding_type: medusa, speculative_model: <heads>, max_draft_len: 3}`` builds from the
checkpoint with the heads converted in (trtpipe/engine/medusa_heads.py: what trtllm-build would read), writes
Triton's ``medusa_choices`` (``"{0}, {0, 0}, {0, 0, 0}"``, tensorrtllm_backend ``docs/model_config.md@7bc57da0``),
and the twin's ``tensorrt_llm`` model drafts with the heads in its engine checkpoint. Shown: the parameters as
written, greedy text through the ensemble identical with and without Medusa, and the acceptance outputs consistent
with drafting (random heads: their acceptance is measured, not asserted). A third server runs a tree with siblings
(``medusa_choices`` of 10 candidates over heads fitted to the target's text, max_draft_len 10): the same greedy text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import Client, GenerateOptions  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

K = 3
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]
PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball."]


@pytest.fixture(scope="module")
def servers(stories_dir, stories_recipe, tmp_path_factory):
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.medusa_heads import with_medusa_heads
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.models.synthetic_heads import fit_medusa_heads, make_medusa_heads

    root = tmp_path_factory.mktemp("medusa_triton")
    heads = make_medusa_heads(stories_dir, root / "heads", num_heads=4, seed=3)
    ckpt = convert(stories_dir, root / "ckpt", tp=1, dtype="float32")
    base = ("model.dtype=float32",)
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
    fitted, _ = fit_medusa_heads(stories_dir, root / "fitted", 4, samples=256, length=48)
    tree = stories_recipe(
        *base,
        "speculative.decoding_type=medusa",
        f"speculative.speculative_model={fitted}",
        f"speculative.max_draft_len={len(TREE)}",
        "speculative.medusa_choices=" + json.dumps(TREE).replace(" ", ""),
    )
    with with_medusa_heads(tree, ckpt, root / "tree") as built_from:
        tree_engine = write_twin_engine(built_from, root / "engine-tree", dict(BUILD_CONFIG))
    write_repo(tree, tree_engine, tree_engine / "checkpoint", root / "tree-repo")
    with (
        start_server(root / "plain", timeout=240) as plain,
        start_server(root / "spec", timeout=240) as s,
        start_server(root / "tree-repo", timeout=240) as t,
    ):
        yield plain, s, medusa_engine, t


def test_the_repository_writes_the_choices_and_the_heads_are_in_the_engine(servers):
    import tritonclient.grpc as grpcclient

    _, spec, engine, _ = servers
    with grpcclient.InferenceServerClient(spec.grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    assert params["medusa_choices"]["string_value"] == "{0}, {0, 0}, {0, 0, 0}"
    extras = json.loads(params["executor_extras"]["string_value"])
    assert (extras["speculative_decoding_type"], extras["max_draft_len"]) == ("Medusa", K)
    ckpt = json.loads((engine / "checkpoint" / "config.json").read_text())
    assert (ckpt["architecture"], ckpt["num_medusa_heads"]) == ("MedusaForCausalLM", 4)


def test_greedy_text_identical_with_and_without_medusa(servers):
    plain, spec, *_ = servers
    opts = GenerateOptions(max_tokens=40)
    with Client(plain.grpc_url, model="ensemble") as a, Client(spec.grpc_url, model="ensemble") as b:
        for prompt in PROMPTS:
            without = a.generate(prompt, opts)
            assert len(without) > 40, without
            assert b.generate(prompt, opts) == without, prompt


def test_acceptance_outputs_come_from_drafting(servers):
    import tritonclient.grpc as grpcclient

    from trtpipe.triton.client import infer_inputs

    plain, spec, *_ = servers
    ids, n = [1, 403, 407, 261, 378], 20
    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
    ]
    names = ("output_ids", "sequence_length", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
    out = []
    for server in (plain, spec):
        with grpcclient.InferenceServerClient(server.grpc_url) as raw:
            r = raw.infer(
                "tensorrt_llm",
                infer_inputs(grpcclient, rows),
                outputs=[grpcclient.InferRequestedOutput(x) for x in names],
            )
        out.append({x: r.as_numpy(x).reshape(-1) for x in names})
    base, got = out
    assert got["output_ids"][:n].tolist() == base["output_ids"][:n].tolist()
    drafts, accepted = int(got["total_draft_tokens"][0]), int(got["total_accepted_draft_tokens"][0])
    # each verification drafts min(3, tokens left - 1) and emits accepted + 1: at least 20 / 4 verifications
    assert drafts >= 3 * ((n - 1) // (K + 1)) and 0 <= accepted <= drafts
    assert abs(float(got["acceptance_rate"][0]) - accepted / drafts) < 1e-6
    assert int(base["total_draft_tokens"][0]) == 0
    print(f"random heads through tritonserver: {accepted} of {drafts} drafts accepted")


def test_a_tree_of_choices_through_tritonserver_keeps_greedy_text(servers):
    """medusa_choices with siblings: the repository writes the tree, the twin's tensorrt_llm model verifies it with
    the tree mask (trtpipe/serving/tree_verify.py) and the greedy text equals the plain server's; the acceptance
    outputs count the tree's nodes as drafts."""
    import tritonclient.grpc as grpcclient

    from trtpipe.triton.client import infer_inputs

    plain, _, _, tree = servers
    with grpcclient.InferenceServerClient(tree.grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    assert params["medusa_choices"]["string_value"] == ", ".join("{" + ", ".join(map(str, c)) + "}" for c in TREE)
    opts = GenerateOptions(max_tokens=40)
    with Client(plain.grpc_url, model="ensemble") as a, Client(tree.grpc_url, model="ensemble") as b:
        for prompt in PROMPTS:
            assert b.generate(prompt, opts) == a.generate(prompt, opts), prompt
    ids, n = [1, 403, 407, 261, 378], 20
    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
    ]
    names = ("output_ids", "total_accepted_draft_tokens", "total_draft_tokens")
    with grpcclient.InferenceServerClient(tree.grpc_url) as raw:
        r = raw.infer(
            "tensorrt_llm", infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
        )
    drafts, accepted = int(r.as_numpy(names[2]).reshape(-1)[0]), int(r.as_numpy(names[1]).reshape(-1)[0])
    # every verification but the last few drafts the whole tree (10 nodes) and emits at most depth 4 + 1 tokens
    assert drafts >= len(TREE) * ((n - 1) // 5 - 1) and 0 <= accepted <= (n - 1)
    print(f"fitted Medusa heads, tree of {len(TREE)}, through tritonserver: {accepted} of {drafts} drafts accepted")
