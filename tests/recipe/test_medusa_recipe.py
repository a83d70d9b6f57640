"""``speculative.decoding_type: medusa`` on the engine target: each misuse is one line naming its key; a valid one
builds with trtllm-build's medusa mode and ``max_draft_len`` = the choices' count, writes Triton's
``medusa_choices`` in the backend's brace format, and reaches the twin's executor as Medusa (a chain, or a tree
with siblings that the executor gets as ``medusa_choices``)."""

from __future__ import annotations

import json

import pytest

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.models.synthetic_heads import make_medusa_heads

BASE = """\
name: medusa
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
  decoding_type: medusa
  speculative_model: {heads}
{spec}"""


@pytest.fixture(scope="module")
def heads(tmp_path_factory, stories_dir):
    return make_medusa_heads(stories_dir, tmp_path_factory.mktemp("mh") / "heads", num_heads=4, seed=1)


def _recipe(tmp_path, stories_dir, heads, spec: str, check=False):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.format(model=stories_dir, heads=heads, spec=spec))
    return load_recipe(p, check_rules=check)


def _problems(r) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_recipe(r)]


def test_a_chain_is_valid_built_written_and_executed(tmp_path, stories_dir, heads):
    from trtpipe.engine.build_config import resolve_build, to_argv, to_json
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config
    from trtpipe.recipe.knobs import twin_extras
    from trtpipe.serving.config import from_recipe

    r = _recipe(tmp_path, stories_dir, heads, "  max_draft_len: 3\n  medusa_choices: [[0], [0, 0], [0, 0, 0]]\n")
    assert _problems(r) == []
    build = resolve_build(r, predicted_checkpoint_config(read_hf_config(stories_dir), r))
    argv = to_argv(build, "ckpt", "out")
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "medusa", "--max_draft_len", "3"]
    assert to_json(build.config)["speculative_decoding_mode"] == 4  # SpeculativeDecodingMode.MEDUSA
    from trtpipe.recipe.medusa import triton_choices

    assert triton_choices(r) == "{0}, {0, 0}, {0, 0, 0}"
    c = from_recipe(r, 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("Medusa", 3, str(heads))
    assert json.loads(twin_extras(r))["speculative_decoding_type"] == "Medusa"


def test_a_tree_is_valid_and_reaches_the_executor(tmp_path, stories_dir, heads):
    from trtpipe.recipe.knobs import twin_extras
    from trtpipe.recipe.medusa import triton_choices
    from trtpipe.serving.config import from_recipe

    r = _recipe(tmp_path, stories_dir, heads, "  max_draft_len: 4\n  medusa_choices: [[0], [1], [0, 0], [0, 1]]\n")
    assert _problems(r) == []
    assert triton_choices(r) == "{0}, {1}, {0, 0}, {0, 1}"
    assert from_recipe(r, 512).medusa_choices == [[0], [1], [0, 0], [0, 1]]
    # Triton carries the tree in its own medusa_choices parameter, not in the twin's extras
    assert "medusa_choices" not in json.loads(twin_extras(r))


def test_unset_choices_are_the_chain_of_max_draft_len(tmp_path, stories_dir, heads):
    from trtpipe.recipe.medusa import choices, triton_choices

    r = _recipe(tmp_path, stories_dir, heads, "  max_draft_len: 2\n")
    assert _problems(r) == [] and choices(r) == [[0], [0, 0]] and triton_choices(r) == "{0}, {0, 0}"


@pytest.mark.parametrize(
    "spec, line",
    [
        (
            "  max_draft_len: 2\n  medusa_choices: [[0], [1, 0]]\n",
            "speculative.medusa_choices: not a tree of candidates: [1, 0] has no parent [1] in the choices",
        ),
        (
            "  max_draft_len: 4\n  medusa_choices: [[0], [0, 0], [0, 0, 0]]\n",
            "speculative.max_draft_len: 4 differs from the 3 candidates of medusa_choices",
        ),
        ("  max_draft_len: 2\n  num_medusa_heads: 5\n", "speculative.num_medusa_heads: 5 exceeds the 4 heads in"),
        (
            "  max_draft_len: 3\n  num_medusa_heads: 2\n",
            "speculative.medusa_choices: a path of depth 3 needs 3 heads; 2 are converted",
        ),
        (
            "  max_draft_len: 1\n  medusa_choices: [[-1]]\n",
            "speculative.medusa_choices: not a tree of candidates: [-1] is not a non-empty",
        ),
    ],
)
def test_misuse_is_one_line_naming_the_key(tmp_path, stories_dir, heads, spec, line):
    problems = _problems(_recipe(tmp_path, stories_dir, heads, spec))
    assert any(p.startswith(line) for p in problems), problems
    assert all("\n" not in p for p in problems)


def test_heads_without_their_config_or_weights_are_refused(tmp_path, stories_dir, heads):
    bare = tmp_path / "bare"
    bare.mkdir()
    problems = _problems(_recipe(tmp_path, stories_dir, bare, "  max_draft_len: 2\n"))
    assert any(p.startswith("speculative.speculative_model: Medusa heads:") for p in problems), problems
    (bare / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    problems = _problems(_recipe(tmp_path, stories_dir, bare, "  max_draft_len: 2\n"))
    assert any("no medusa_lm_head.pt or medusa_lm_head.safetensors" in p for p in problems), problems


def test_medusa_keys_need_decoding_type_medusa(tmp_path, stories_dir, heads):
    p = tmp_path / "r.yaml"
    text = BASE.format(model=stories_dir, heads=heads, spec="  medusa_choices: [[0]]\n")
    p.write_text(text.replace("decoding_type: medusa", "decoding_type: draft_tokens_external"))
    problems = _problems(load_recipe(p, check_rules=False))
    assert any(x.startswith("speculative.medusa_choices: only decoding_type medusa takes") for x in problems)
