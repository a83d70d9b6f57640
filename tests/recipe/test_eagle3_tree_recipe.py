"""EAGLE-3's static tree in a recipe (``speculative.eagle_choices`` with ``decoding_type: Eagle3``): accepted in the
two-model form as TensorRT-LLM's PyTorch backend runs it, written into the trtllm-serve YAML's ``speculative_config``
(``eagle_choices``, ``max_draft_len`` the tree's depth), the Triton llmapi model.yaml, the Dynamo worker's
--extra-engine-args and the twin's executor config; each refusal one line naming its key (trtpipe/recipe/eagle.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.export.serving import llm_api_options, model_yaml
from trtpipe.models.synthetic_heads import deepened_llama, make_eagle3_head

TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]

RECIPE = """\
name: e3tree
target: llmapi
model:
  source: {model}
engine:
  gpu: h100-sxm-80gb
  max_batch_size: 4
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 2048
  kv_cache:
    enable_reuse: false
accuracy:
  enabled: false
llmapi:
  version: "{version}"
speculative:
  decoding_type: Eagle3
  speculative_model: {head}
{spec}
"""


@pytest.fixture(scope="module")
def target_and_head(stories_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("e3tree-recipe")
    deep = deepened_llama(stories_dir, root / "stories-8l")  # upstream's EAGLE-3 capture needs more than 5 layers
    return deep, make_eagle3_head(deep, root / "head", seed=3)


def _write(tmp_path: Path, target_and_head, spec: str, version: str = "1.2") -> Path:
    model, head = target_and_head
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.format(model=model, head=head, spec=spec, version=version))
    return p


def _problems(path) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_recipe(load_recipe(path, check_rules=False))]


TREE_SPEC = f"  eagle3_one_model: false\n  max_draft_len: {len(TREE)}\n  eagle_choices: {TREE}"


def test_a_two_model_tree_is_written_where_every_front_end_reads_it(tmp_path, target_and_head):
    from trtpipe.deploy.dynamo import ROLES, engine_options
    from trtpipe.serving.config import from_json, from_recipe, to_json

    path = _write(tmp_path, target_and_head, TREE_SPEC)
    assert _problems(path) == []
    r = load_recipe(path)
    written = llm_api_options(r, "1.2")["speculative_config"]
    assert written["eagle_choices"] == TREE and written["max_draft_len"] == 3  # upstream's spelling: the depth
    assert written["eagle3_one_model"] is False and written["decoding_type"] == "Eagle3"
    assert model_yaml(r, "/m")["speculative_config"] == written  # the Triton llmapi model
    for role in ROLES:  # the Dynamo worker's --extra-engine-args
        assert engine_options(r, role)["speculative_config"] == written, role
    c = from_recipe(r, 512)  # the twin drafts the same tree, max_draft_len its draft tokens
    assert (c.speculative_decoding_type, c.max_draft_len) == ("Eagle3", len(TREE))
    assert c.eagle_choices == "{0}, {1}, {0, 0}, {0, 1}, {0, 0, 0}"
    assert from_json(to_json(c)) == c
    chain = load_recipe(_write(tmp_path, target_and_head, "  max_draft_len: 3"))  # no tree: nothing more written
    assert "eagle_choices" not in llm_api_options(chain, "1.2")["speculative_config"]
    assert from_recipe(chain, 512).eagle_choices == ""


DYN_SPEC = (
    "  eagle3_one_model: true\n  max_draft_len: 3\n  use_dynamic_tree: true\n  dynamic_tree_max_top_k: 3\n"
    "  max_total_draft_tokens: 8"
)


def test_a_one_model_dynamic_tree_is_written_where_every_front_end_reads_it(tmp_path, target_and_head):
    """upstream's names: use_dynamic_tree, dynamic_tree_max_topK, max_total_draft_tokens, max_draft_len the depth;
    the twin reserves the tree's draft tokens and drafts it (trtpipe/serving/dynamic_tree.py)."""
    from trtpipe.deploy.dynamo import ROLES, engine_options
    from trtpipe.serving.config import from_json, from_recipe, to_json

    path = _write(tmp_path, target_and_head, DYN_SPEC, "1.3")
    assert _problems(path) == []
    r = load_recipe(path)
    written = llm_api_options(r, "1.3")["speculative_config"]
    assert written["use_dynamic_tree"] is True and written["dynamic_tree_max_topK"] == 3
    assert written["max_total_draft_tokens"] == 8 and written["max_draft_len"] == 3
    assert written["eagle3_one_model"] is True and "eagle_choices" not in written
    assert model_yaml(r, "/m")["speculative_config"] == written  # the Triton llmapi model
    for role in ROLES:  # the Dynamo worker's --extra-engine-args
        assert engine_options(r, role)["speculative_config"] == written, role
    c = from_recipe(r, 512)
    assert (c.max_draft_len, c.dynamic_tree_max_top_k, c.dynamic_tree_depth, c.eagle_choices) == (8, 3, 3, "")
    from trtpipe.recipe.lookahead import draft_len

    assert draft_len(r) == 8  # the tokens one verification holds: what the planner reserves per sequence
    assert from_json(to_json(c)) == c


CASES = {
    "one-model": (
        f"  eagle3_one_model: true\n  max_draft_len: {len(TREE)}\n  eagle_choices: {TREE}",
        "1.2",
        "speculative.eagle_choices: the one-model EAGLE-3 drafter never builds the static tree",
    ),
    "dynamic-two-model": (
        DYN_SPEC.replace("eagle3_one_model: true", "eagle3_one_model: false"),
        "1.3",
        "speculative.use_dynamic_tree: upstream drafts the dynamic tree in the one-model form only",
    ),
    "dynamic-release": (DYN_SPEC, "1.2", "speculative.use_dynamic_tree: llmapi.version 1.2: trtpipe writes EAGLE-3's"),
    "dynamic-with-choices": (
        DYN_SPEC + "\n  eagle_choices: [[0], [1]]",
        "1.3",
        "speculative.use_dynamic_tree: use_dynamic_tree and eagle_choices are mutually exclusive",
    ),
    "dynamic-top-k-1": (
        DYN_SPEC.replace("dynamic_tree_max_top_k: 3", "dynamic_tree_max_top_k: 1"),
        "1.3",
        "speculative.dynamic_tree_max_top_k: 1: the dynamic tree needs dynamic_tree_max_topK >= 2",
    ),
    "dynamic-no-total": (
        DYN_SPEC.replace("\n  max_total_draft_tokens: 8", ""),
        "1.3",
        "speculative.max_total_draft_tokens: the dynamic tree needs max_total_draft_tokens",
    ),
    "dynamic-too-many": (
        DYN_SPEC.replace("max_total_draft_tokens: 8", "max_total_draft_tokens: 22"),
        "1.3",
        "speculative.max_total_draft_tokens: 22 exceeds the 21 nodes",
    ),
    "dynamic-top-k-alone": (
        "  dynamic_tree_max_top_k: 4",
        "1.2",
        "speculative.dynamic_tree_max_top_k: dynamic_tree_max_top_k is read only with use_dynamic_tree: true",
    ),
    "total-alone": (
        "  max_total_draft_tokens: 4",
        "1.3",
        "speculative.max_total_draft_tokens: max_total_draft_tokens is read only with use_dynamic_tree: true",
    ),
    "release": (TREE_SPEC, "1.1", "speculative.eagle_choices: llmapi.version 1.1: trtpipe writes EAGLE-3's"),
    "not-connected": (
        "  eagle3_one_model: false\n  max_draft_len: 2\n  eagle_choices: [[0], [1, 0]]",
        "1.2",
        "speculative.eagle_choices: choice [1, 0] is not connected",
    ),
    "size": (
        f"  eagle3_one_model: false\n  max_draft_len: 3\n  eagle_choices: {TREE}",
        "1.2",
        "speculative.max_draft_len: 3 differs from the 5 draft tokens of eagle_choices",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_misuse_is_one_line_naming_the_key(case, tmp_path, target_and_head):
    spec, version, expected = CASES[case]
    problems = _problems(_write(tmp_path, target_and_head, spec, version))
    assert any(p.startswith(expected) for p in problems), problems
    assert all("\n" not in p for p in problems)
