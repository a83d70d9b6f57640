"""Lookahead decoding in a recipe: per target one line, the engine's --max_draft_len from (W, N, G) by upstream's
formula, and the Triton tensorrt_llm model's decoding_mode / lookahead_* parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.engine import build_config as bc
from trtpipe.engine.ckptconfig import predicted_checkpoint_config
from trtpipe.models.dims import read_hf_config
from trtpipe.recipe.lookahead import LookaheadConfig, draft_len, recipe_config, triton_parameters

BASE = """\
name: la
target: {target}
model:
  source: {model}
engine:
  gpu: h100-sxm-80gb
  max_batch_size: 4
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: {tokens}
accuracy:
  enabled: false
speculative:
{spec}
"""


def _recipe(tmp_path: Path, stories_dir, spec: str, target="engine", tokens=2048):
    p = tmp_path / "r.yaml"
    p.write_text(BASE.format(target=target, model=stories_dir, tokens=tokens, spec=spec))
    return load_recipe(p, check_rules=False)


def _problems(recipe) -> list[str]:
    return [f"{p.key}: {p.message}" for p in check_recipe(recipe)]


SPEC = "  decoding_type: lookahead_decoding\n  max_window_size: 5\n  max_ngram_size: 4\n  max_verification_set_size: 3"


def test_the_engine_is_built_with_upstreams_draft_length(tmp_path, stories_dir):
    r = _recipe(tmp_path, stories_dir, SPEC)
    assert recipe_config(r) == LookaheadConfig(5, 4, 3)
    assert draft_len(r) == (4 - 2) + (5 - 1 + 3) * (4 - 1) == 23  # calculateSpeculativeResourceTuple
    build = bc.resolve_build(r, predicted_checkpoint_config(read_hf_config(stories_dir), r))
    argv = bc.to_argv(build, "/ckpt", "/out")
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "lookahead_decoding", "--max_draft_len", "23"]
    assert bc.to_json(build.config)["speculative_decoding_mode"] == 8  # LOOKAHEAD_DECODING


def test_defaults_are_the_executors(tmp_path, stories_dir):
    from trtpipe.engine.draft_plan import draft_memory

    r = _recipe(tmp_path, stories_dir, "  decoding_type: lookahead_decoding")
    assert recipe_config(r) == LookaheadConfig(4, 3, 4) and draft_len(r) == 15
    # the plan: no draft weights, each sequence grows by the 15 draft positions
    assert draft_memory(r, 1, 2.0) == type(draft_memory(r, 1, 2.0))(0, 0.0, 15, "none")


def test_the_triton_model_gets_decoding_mode_lookahead_and_the_executor_sizes(tmp_path, stories_dir):
    from trtpipe.triton import repo as R

    r = _recipe(tmp_path, stories_dir, SPEC)
    assert triton_parameters(r) == {
        "decoding_mode": "lookahead",
        "lookahead_window_size": 5,
        "lookahead_ngram_size": 4,
        "lookahead_verification_set_size": 3,
    }
    engine = R.EngineInfo(tmp_path, False, 1, 4, 1, 256, 512)
    params = R.tensorrt_llm_config(r, engine).parameters
    assert params["decoding_mode"].string_value == "lookahead"
    assert [params[k].string_value for k in R.LOOKAHEAD_PARAMETERS] == ["5", "4", "3"]
    plain = R.tensorrt_llm_config(_recipe(tmp_path, stories_dir, "  decoding_type: none"), engine).parameters
    assert plain["decoding_mode"].string_value == "top_k_top_p"
    assert [plain[k].string_value for k in R.LOOKAHEAD_PARAMETERS] == ["", "", ""]


CASES = {
    "llmapi": (
        "  decoding_type: Lookahead",
        {"target": "llmapi"},
        "speculative.decoding_type: Lookahead is not supported by TensorRT-LLM's PyTorch backend",
    ),
    "llmapi-spelling-on-engine": (
        "  decoding_type: Lookahead",
        {},
        "speculative.decoding_type: Lookahead is the LLM API's spelling; target engine takes trtllm-build's: "
        "decoding_type: lookahead_decoding",
    ),
    "illegal": (
        "  decoding_type: lookahead_decoding\n  max_ngram_size: 1\n  max_window_size: 2\n  max_verification_set_size: 0",
        {},
        "speculative.max_ngram_size: lookahead (w 2, n 1, g 0): ngram size 1 requires window size 1",
    ),
    "draft-len-set-wrong": (
        "  decoding_type: lookahead_decoding\n  max_draft_len: 7",
        {},
        "speculative.max_draft_len: lookahead (w 4, n 3, g 4) drafts 15 tokens per step",
    ),
    "tokens-per-step": (
        "  decoding_type: lookahead_decoding",
        {"tokens": 32},
        "engine.max_num_tokens: 32 tokens per step cannot verify a full batch: max_batch_size 4 x (max_draft_len 15 "
        "+ 1) = 64",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_misuse_is_one_line(tmp_path, stories_dir, case):
    spec, kw, expected = CASES[case]
    problems = _problems(_recipe(tmp_path, stories_dir, spec, **kw))
    assert [p for p in problems if p.startswith(expected)], problems
    assert sum(p.startswith("speculative.decoding_type") for p in problems) <= 1, problems


def test_the_draft_length_may_be_given_when_it_is_upstreams(tmp_path, stories_dir):
    problems = _problems(_recipe(tmp_path, stories_dir, "  decoding_type: lookahead_decoding\n  max_draft_len: 15"))
    assert not [p for p in problems if p.startswith("speculative.max_draft_len")], problems
