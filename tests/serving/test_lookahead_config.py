"""Lookahead decoding's configuration on the twin: the Triton model's decoding_mode / lookahead_* parameters become
the executor's (W, N, G) and draft length; a request's lookahead_* inputs are all three or none, at most the model's
and only on a model with lookahead; sampling is refused (upstream's layer is top-1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtpipe.serving.api import Request, SamplingParams
from trtpipe.serving.config import executor_config
from trtpipe.serving.lookahead import GREEDY_ONLY, executor_knobs, executor_lookahead, request_problem, request_sizes
from trtpipe.recipe.lookahead import LookaheadConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
PARAMS = {"lookahead_window_size": "4", "lookahead_ngram_size": "3", "lookahead_verification_set_size": "2"}


def _config(**knobs):
    return executor_config(
        max_batch_size=2, max_num_tokens=256, max_input_len=100, max_seq_len=128, tokens_per_block=8, **knobs
    )


def test_the_models_parameters_become_the_executors_configuration():
    assert executor_knobs("top_k_top_p", PARAMS) == {}  # the backend reads lookahead_* only in lookahead mode
    knobs = executor_knobs("lookahead", PARAMS, engine_max_draft_len=1 + 5 * 2)
    assert knobs == {
        "speculative_decoding_type": "Lookahead",
        "max_draft_len": 11,
        "lookahead_window_size": 4,
        "lookahead_ngram_size": 3,
        "lookahead_verification_set_size": 2,
    }
    assert executor_lookahead(_config(**knobs)) == LookaheadConfig(4, 3, 2)
    assert executor_lookahead(_config()) is None


@pytest.mark.parametrize(
    "params, engine, message",
    [
        ({**PARAMS, "lookahead_ngram_size": None}, None, "set lookahead_window_size, lookahead_ngram_size and"),
        ({**PARAMS, "lookahead_ngram_size": "x"}, None, "must be integers"),
        ({**PARAMS, "lookahead_ngram_size": "1"}, None, r"lookahead \(w 4, n 1, g 2\): ngram size 1 requires"),
        (PARAMS, 7, "drafts 11 tokens per step but the engine was built with max_draft_len 7"),
    ],
)
def test_bad_parameters_are_one_line(params, engine, message):
    with pytest.raises(ValueError, match=message):
        executor_knobs("lookahead", params, engine)


def test_request_inputs_are_all_three_or_none():
    def get(d):
        return lambda n: d.get(n)

    one = np.array([[2]], np.int32)
    assert request_sizes(get({})) is None
    full = {"lookahead_window_size": one, "lookahead_ngram_size": one * 3 // 2, "lookahead_verification_set_size": one}
    assert request_sizes(get(full)) == (2, 3, 2)
    with pytest.raises(ValueError, match="give all three or none"):
        request_sizes(get({"lookahead_window_size": one}))


def test_a_request_is_checked_against_the_executors_configuration():
    la = _config(**executor_knobs("lookahead", PARAMS))
    plain = _config()
    greedy = SamplingParams(0.0, 0, 1.0, None)
    assert request_problem(la, Request([1, 2], 4, sampling=greedy)) is None
    assert request_problem(la, Request([1, 2], 4, sampling=greedy, lookahead=(4, 3, 2))) is None
    assert request_problem(la, Request([1, 2], 4, sampling=greedy, lookahead=(2, 2, 0))) is None
    assert "exceeds the model's (w 4, n 3, g 2)" in request_problem(la, Request([1, 2], 4, lookahead=(4, 4, 2)))
    assert "ngram size 1 requires" in request_problem(la, Request([1, 2], 4, lookahead=(2, 1, 0)))
    assert "can only be set if the model instance lookahead parameters" in request_problem(
        plain, Request([1, 2], 4, lookahead=(2, 2, 0))
    )
    assert request_problem(la, Request([1, 2], 4, sampling=SamplingParams(0.8, 0, 1.0, 1))) == GREEDY_ONLY
    assert request_problem(plain, Request([1, 2], 4, sampling=SamplingParams(0.8, 0, 1.0, 1))) is None


def test_the_twin_parses_the_request_inputs():
    from trtpipe.serving.triton_adapter import TwinSettings, parse_request

    arrays = {
        "input_ids": np.array([[5, 6, 7]], np.int32),
        "request_output_len": np.array([[4]], np.int32),
        "lookahead_window_size": np.array([[3]], np.int32),
        "lookahead_ngram_size": np.array([[3]], np.int32),
        "lookahead_verification_set_size": np.array([[1]], np.int32),
    }
    s = TwinSettings(Path("."), _config(**executor_knobs("lookahead", PARAMS)), False, 2, 1, 512)
    assert parse_request(arrays.get, s, decoupled=False).request.lookahead == (3, 3, 1)
    del arrays["lookahead_ngram_size"]
    with pytest.raises(ValueError, match="give all three or none"):
        parse_request(arrays.get, s, decoupled=False)


@pytest.mark.slow  # converts a checkpoint and writes an engine and a repository (seconds)
def test_the_repository_the_recipe_writes_is_what_the_twin_reads(tmp_path):
    """recipe -> trtllm-build config -> twin engine -> Triton repository -> the stub's reading of it."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from trtpipe.app.validation import load_recipe
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.build_config import resolve_build, to_json as build_json
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.serving.triton_adapter import settings_from_model_config
    from trtpipe.triton import repo as R

    recipe = load_recipe(
        RECIPES / "stories-fp16.yaml",
        [
            "target=engine",
            "speculative.decoding_type=lookahead_decoding",
            "speculative.max_window_size=3",
            "speculative.max_ngram_size=4",
            "speculative.max_verification_set_size=2",
        ],
        check_rules=False,
    )
    ckpt = convert(recipe.resolve(recipe.model.source), tmp_path / "ckpt", tp=1, dtype="float16")
    build = resolve_build(recipe, json.loads((ckpt / "config.json").read_text()))
    engine = write_twin_engine(ckpt, tmp_path / "engine", build_json(build.config))
    R.write_repo(recipe, engine, engine / "checkpoint", tmp_path / "repo")
    pbtxt = text_format.Parse((tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text(), mc.ModelConfig())
    model_config = json_format.MessageToDict(pbtxt, preserving_proto_field_name=True)
    executor = settings_from_model_config(model_config, str(tmp_path / "repo" / "tensorrt_llm")).executor
    assert executor.speculative_decoding_type == "Lookahead" and executor.max_draft_len == 2 + 4 * 3 == 14
    assert executor_lookahead(executor) == LookaheadConfig(3, 4, 2)
    extras = json.loads(model_config["parameters"]["executor_extras"]["string_value"])
    assert not {"speculative_decoding_type", "max_draft_len", "lookahead_window_size"} & set(extras)
