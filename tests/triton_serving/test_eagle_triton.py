"""EAGLE-1/2 served by a real tritonserver through the CPU twin (engine target).

The recipe's ``speculative: {decoding_type: eagle, speculative_model: <head>, max_draft_len: 3}`` builds from the
checkpoint with the head converted in (trtpipe/engine/eagle_heads.py: the ``EagleForCausalLM`` checkpoint
trtllm-build would read), writes Triton's ``eagle_choices`` (``"{0}, {0, 0}, {0, 0, 0}"``, the brace format of
tensorrtllm_backend ``docs/model_config.md@7bc57da0``), and the twin's ``tensorrt_llm`` model drafts with the head in
its engine checkpoint. Shown: the parameters as written, greedy text through the ensemble identical with and without
EAGLE, and the acceptance outputs consistent with drafting (a random head: its acceptance is measured, not
asserted). The Medusa test (test_medusa_triton.py) runs the same checks on its heads.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from test_medusa_triton import (  # noqa: E402
    test_acceptance_outputs_come_from_drafting,  # noqa: F401 - run here on the EAGLE repository's servers
    test_greedy_text_identical_with_and_without_medusa as test_greedy_text_identical_with_and_without_eagle,  # noqa: F401
)
from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

K = 3


# the chain of K, and a static tree of K nodes (siblings at depth 1), verified with h-tree's tree mask
SHAPES = {"chain": ("{0}, {0, 0}, {0, 0, 0}", None), "tree": ("{0}, {1}, {0, 0}", "[[0], [1], [0, 0]]")}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def servers(request, stories_dir, stories_recipe, tmp_path_factory):
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.eagle_heads import with_eagle_head
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.models.synthetic_heads import make_eagle1_head

    root = tmp_path_factory.mktemp("eagle_triton")
    head = make_eagle1_head(stories_dir, root / "head", seed=3)
    ckpt = convert(stories_dir, root / "ckpt", tp=1, dtype="float32")
    base = ("model.dtype=float32",)
    spec = (
        "speculative.decoding_type=eagle",
        f"speculative.speculative_model={head}",
        f"speculative.max_draft_len={K}",
    )
    if SHAPES[request.param][1]:
        spec += (f"speculative.eagle_choices={SHAPES[request.param][1]}",)
    plain_engine = write_twin_engine(ckpt, root / "engine", dict(BUILD_CONFIG))
    recipe = stories_recipe(*base, *spec)
    with with_eagle_head(recipe, ckpt, root) as built_from:
        eagle_engine = write_twin_engine(built_from, root / "engine-eagle", dict(BUILD_CONFIG))
    write_repo(stories_recipe(*base), plain_engine, plain_engine / "checkpoint", root / "plain")
    write_repo(recipe, eagle_engine, eagle_engine / "checkpoint", root / "spec")
    with start_server(root / "plain", timeout=240) as plain, start_server(root / "spec", timeout=240) as s:
        yield plain, s, eagle_engine


def test_the_repository_writes_the_choices_and_the_head_is_in_the_engine(servers, request):
    import tritonclient.grpc as grpcclient

    _, spec, engine = servers
    shape = request.node.callspec.params["servers"]
    with grpcclient.InferenceServerClient(spec.grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    choices = SHAPES[shape][0]
    assert params["eagle_choices"]["string_value"] == choices
    extras = json.loads(params["executor_extras"]["string_value"])
    assert (extras["speculative_decoding_type"], extras["max_draft_len"]) == ("Eagle", K)
    assert extras["eagle_choices"] == choices  # the twin's executor drafts this tree
    ckpt = json.loads((engine / "checkpoint" / "config.json").read_text())
    depth, non_leaves = (K, 1) if shape == "chain" else (2, 1)
    keys = ("architecture", "num_eagle_layers", "max_draft_len", "max_non_leaves_per_layer")
    assert tuple(ckpt[k] for k in keys) == ("EagleForCausalLM", depth, K, non_leaves)
