"""EAGLE-3 trees of a ``target: llmapi`` recipe through a real tritonserver, served by the twin of TensorRT-LLM's
Triton ``llmapi`` model on the executor configuration the recipe writes (``twin_executor_config``): the static tree
(``speculative.eagle_choices``, two-model as upstream drafts trees) and EAGLE-2's dynamic tree (``use_dynamic_tree``,
one-model, llmapi 1.3). Greedy ``text_output`` is identical to the same repository without speculation over a prompt
set, and the perf outputs report drafting (every tree node a draft) and accepted drafts.

The target is stories260k deepened to 8 layers, the head trained on its own text (as
tests/export/test_openai_eagle3_tree.py serves it through the OpenAI twin)."""

from __future__ import annotations

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from eagle3_trees import PROMPTS, RECIPE, SPECS, TREE  # noqa: E402
from test_speculative_llmapi_triton import _generate  # noqa: E402

from trtpipe.triton.llmapi_repo import write_llmapi_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, stories_dir):
    """ "off" and each tree mode -> a tritonserver of the llmapi twin."""
    from contextlib import ExitStack

    from trtpipe.app.validation import check_recipe, load_recipe
    from trtpipe.models.synthetic_heads import deepened_llama, train_eagle3_head
    from trtpipe.serving.config import from_recipe, replace_knobs, to_json

    root = tmp_path_factory.mktemp("eagle3_tree_llmapi")
    d = deepened_llama(stories_dir, root / "stories-8l")
    head, _, _ = train_eagle3_head(d, root / "head", 150, samples=256)
    configs = {}
    for mode, spec in SPECS.items():
        path = root / f"{mode}.yaml"
        path.write_text(RECIPE.format(model=d, head=head, spec=spec))
        recipe = load_recipe(path)
        assert check_recipe(recipe) == []
        configs[mode] = (recipe, from_recipe(recipe, 512))
    recipe, on = configs["static"]
    off = replace_knobs(
        on,
        speculative_decoding_type="",
        max_draft_len=0,
        speculative_model="",
        eagle_choices="",
        dynamic_tree_max_top_k=0,
        dynamic_tree_depth=0,
    )
    configs["off"] = (recipe, off)
    with ExitStack() as stack:
        servers = {}
        for name, (recipe, config) in configs.items():
            write_llmapi_repo(recipe, root / name, str(d), twin_executor_config=to_json(config))
            servers[name] = stack.enter_context(start_server(root / name, timeout=240))
        yield servers


@pytest.mark.parametrize("mode", list(SPECS))
def test_greedy_text_identical_with_an_eagle3_tree(served, mode):
    drafts = accepted = 0
    for prompt in PROMPTS:
        plain = _generate(served["off"], prompt, 40)
        got = _generate(served[mode], prompt, 40)
        assert got["text_output"] == plain["text_output"], (mode, prompt)
        assert int(plain["total_draft_tokens"]) == 0
        drafts += int(got["total_draft_tokens"])
        accepted += int(got["total_accepted_draft_tokens"])
    assert drafts >= len(TREE) * len(PROMPTS) and 0 < accepted <= drafts, (drafts, accepted)
    print(f"EAGLE-3 {mode} tree through tritonserver's llmapi model: {accepted} of {drafts} drafts accepted")
