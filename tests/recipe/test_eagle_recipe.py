"""``speculative.decoding_type: eagle`` (EAGLE-1/2 heads) on the engine target: each misuse is one line naming its
key; a valid chain builds with trtllm-build's eagle mode and ``max_draft_len`` = the choices' count, writes Triton's
``eagle_choices`` in the backend's brace format, converts the head with the tree's depth and non-leaves, and reaches
the twin's executor as Eagle."""

from __future__ import annotations

import json

import pytest

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.models.synthetic_heads import make_eagle1_head

BASE = """\
name: eagle
target: engine
model:
  source: {model}
engine:
  gpu: h100-sxm-80gb
  max_batch_size: 64
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 4096
accuracy:
  enabled: false
speculative:
  decoding_type: eagle
  speculative_model: {head}
{spec}"""


@pytest.fixture(scope="module")
def head(tmp_path_factory, stories_dir):
    return make_eagle1_head(stories_dir, tmp_path_factory.mktemp("eh") / "head", seed=1)


def _recipe(tmp_path, stories_dir, head, spec: str, check=False):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.format(model=stories_dir, head=head, spec=spec))
    return load_recipe(p, check_rules=check)


def _problems(r) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_recipe(r)]


def test_a_chain_is_valid_built_written_and_executed(tmp_path, stories_dir, head):
    from trtpipe.engine.build_config import resolve_build, to_argv, to_json
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config
    from trtpipe.recipe.eagle import choices, tree_shape, triton_choices
    from trtpipe.recipe.knobs import twin_extras
    from trtpipe.serving.config import from_recipe

    r = _recipe(tmp_path, stories_dir, head, "  max_draft_len: 3\n  eagle_choices: [[0], [0, 0], [0, 0, 0]]\n")
    assert _problems(r) == []
    build = resolve_build(r, predicted_checkpoint_config(read_hf_config(stories_dir), r))
    argv = to_argv(build, "ckpt", "out")
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "eagle", "--max_draft_len", "3"]
    assert to_json(build.config)["speculative_decoding_mode"] == 32  # SpeculativeDecodingMode.EAGLE
    assert triton_choices(r) == "{0}, {0, 0}, {0, 0, 0}"
    assert tree_shape(choices(r)) == (3, 1)  # num_eagle_layers, max_non_leaves_per_layer of the chain
    c = from_recipe(r, 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("Eagle", 3, str(head))
    assert json.loads(twin_extras(r))["speculative_decoding_type"] == "Eagle"
    unset = _recipe(tmp_path, stories_dir, head, "  max_draft_len: 2\n")
    assert _problems(unset) == [] and choices(unset) == [[0], [0, 0]]


def test_a_static_tree_is_valid_and_reaches_the_executor(tmp_path, stories_dir, head):
    from trtpipe.recipe.eagle import choices, tree_shape, triton_choices
    from trtpipe.serving.config import from_recipe

    r = _recipe(tmp_path, stories_dir, head, "  max_draft_len: 4\n  eagle_choices: [[0], [1], [0, 0], [1, 0]]\n")
    assert _problems(r) == []
    assert triton_choices(r) == "{0}, {1}, {0, 0}, {1, 0}" and tree_shape(choices(r)) == (2, 2)
    c = from_recipe(r, 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.eagle_choices) == ("Eagle", 4, "{0}, {1}, {0, 0}, {1, 0}")


def test_tree_shape_counts_depth_and_non_leaves_per_level():
    from trtpipe.recipe.eagle import tree_shape

    # upstream's README example: 0 -> {1, 2, 3}, 1 -> 4 -> 6, 2 -> 5 -> 7
    tree = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]]
    assert tree_shape(tree) == (3, 2)


@pytest.mark.parametrize(
    "spec, line",
    [
        (
            "  max_draft_len: 4\n  eagle_choices: [[0], [0, 0], [0, 0, 0]]\n",
            "speculative.max_draft_len: 4 differs from the 3 draft tokens of eagle_choices",
        ),
        (
            "  max_draft_len: 2\n  eagle_choices: [[0], [0, 0, 0]]\n",
            "speculative.eagle_choices: choice [0, 0, 0] is not connected: its prefix [0, 0] is missing",
        ),
        ("  max_draft_len: 1\n  eagle_choices: [[-1]]\n", "speculative.eagle_choices: every choice is a non-empty"),
        (
            "  max_draft_len: 3\n  use_dynamic_tree: true\n  dynamic_tree_max_top_k: 4\n",
            "speculative.use_dynamic_tree: Triton's tensorrt_llm model builds EagleConfig(eagle_choices) alone",
        ),
        (
            "  max_draft_len: 3\n  use_dynamic_tree: true\n  eagle_choices: [[0], [0, 0], [0, 0, 0]]\n",
            "speculative.use_dynamic_tree: use_dynamic_tree and eagle_choices are mutually exclusive",
        ),
        (
            "  max_draft_len: 3\n  dynamic_tree_max_top_k: 4\n",
            "speculative.dynamic_tree_max_top_k: dynamic_tree_max_top_k is read only with use_dynamic_tree: true",
        ),
    ],
)
def test_misuse_is_one_line_naming_the_key(tmp_path, stories_dir, head, spec, line):
    problems = _problems(_recipe(tmp_path, stories_dir, head, spec))
    assert any(p.startswith(line) for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path, stories_dir, head):
    bare = tmp_path / "bare"
    bare.mkdir()
    problems = _problems(_recipe(tmp_path, stories_dir, bare, "  max_draft_len: 2\n"))
    assert any(p.startswith("speculative.speculative_model: EAGLE head:") for p in problems), problems
    cfg = json.loads((head / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(cfg))
    problems = _problems(_recipe(tmp_path, stories_dir, bare, "  max_draft_len: 2\n"))
    assert any("no pytorch_model.bin or model.safetensors" in p for p in problems), problems
    (bare / "pytorch_model.bin").write_bytes((head / "pytorch_model.bin").read_bytes())
    for key, value, why in (
        ("hidden_size", cfg["hidden_size"] * 2, "EAGLE head: hidden_size"),
        ("vocab_size", cfg["vocab_size"] + 8, "EAGLE head: vocab_size"),
    ):
        (bare / "config.json").write_text(json.dumps({**cfg, key: value}))
        problems = _problems(_recipe(tmp_path, stories_dir, bare, "  max_draft_len: 2\n"))
        assert any(p.startswith(f"speculative.speculative_model: {why}") for p in problems), problems


def test_eagle_keys_need_decoding_type_eagle(tmp_path, stories_dir, head):
    p = tmp_path / "r.yaml"
    text = BASE.format(model=stories_dir, head=head, spec="  eagle_choices: [[0]]\n  use_dynamic_tree: true\n")
    p.write_text(text.replace("decoding_type: eagle", "decoding_type: medusa"))
    problems = [f"{x.key}: {x.message}" for x in check_recipe(load_recipe(p, check_rules=False))]
    assert any(x.startswith("speculative.eagle_choices: only decoding_type eagle (or Eagle3) takes") for x in problems)
    assert any(
        x.startswith("speculative.use_dynamic_tree: only decoding_type eagle (or Eagle3) takes") for x in problems
    )
