"""The written Triton configs against upstream's template rows (trtpipe/triton/upstream_io.py), row by row.

Expectations come from the table (one row per tensor, with its template file@commit), not from restated facts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from tritonclient.grpc import model_config_pb2 as mc

from test_repo import llama70b, llama70b_engine  # noqa: F401 - module fixtures
from trtpipe.triton import repo as R
from trtpipe.triton import upstream_io
from trtpipe.serving import twin_input_policy


def _assert_rows(messages, rows, fill):
    assert [m.name for m in messages] == [r.name for r in rows]
    for m, row in zip(messages, rows):
        assert mc.DataType.Name(m.data_type) == fill.get(row.dtype, row.dtype), row.name
        assert list(m.dims) == list(row.dims), row.name
        if isinstance(m, mc.ModelInput):
            assert (m.optional, m.allow_ragged_batch, m.HasField("reshape")) == (
                row.optional,
                row.ragged,
                row.reshape,
            ), row.name
            if row.reshape:
                assert list(m.reshape.shape) == []


def test_template_rows_are_complete_and_sourced():
    for rows in (
        upstream_io.TRTLLM_INPUTS,
        upstream_io.TRTLLM_OUTPUTS,
        upstream_io.PREPROCESSING_INPUTS,
        upstream_io.PREPROCESSING_OUTPUTS,
    ):
        assert all("config.pbtxt@" in r.source for r in rows)
        assert len({r.name for r in rows}) == len(rows)
    assert sum(r.ragged for r in upstream_io.TRTLLM_INPUTS) == 26  # the count the cross-check found upstream
    assert [r.name for r in upstream_io.TRTLLM_INPUTS if not r.optional] == ["input_lengths", "request_output_len"]


def test_tensorrt_llm_io_equals_the_template_for_a_bf16_engine(llama70b, llama70b_engine):  # noqa: F811
    engine = R.EngineInfo.read(llama70b_engine)
    assert engine.dtype == "bfloat16"
    config = R.tensorrt_llm_config(llama70b, engine)
    fill = {"${logits_datatype}": "TYPE_FP32", "${prompt_embedding_table_data_type}": "TYPE_BF16"}
    _assert_rows(config.input, upstream_io.declared(upstream_io.TRTLLM_INPUTS), fill)
    _assert_rows(config.output, upstream_io.declared(upstream_io.TRTLLM_OUTPUTS), fill)
    assert {i.name: i for i in config.input}["prompt_embedding_table"].data_type == mc.TYPE_BF16
    assert "enable_trt_overlap" not in config.parameters  # commented out of the template: deprecated, ignored


def test_placeholders_follow_the_engine(llama70b, llama70b_engine, tmp_path):  # noqa: F811
    cfg = json.loads((llama70b_engine / "config.json").read_text())
    cfg["pretrained_config"].update(dtype="float16", logits_dtype="float16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = R.tensorrt_llm_config(llama70b, R.EngineInfo.read(tmp_path))
    by = {i.name: i for i in list(config.input) + list(config.output)}
    assert by["prompt_embedding_table"].data_type == mc.TYPE_FP16
    assert by["draft_logits"].data_type == by["context_logits"].data_type == mc.TYPE_FP16
    cfg["pretrained_config"]["dtype"] = "int8"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="pretrained_config.dtype 'int8' has no Triton type"):
        R.tensorrt_llm_config(llama70b, R.EngineInfo.read(tmp_path))


def test_preprocessing_follows_the_template(llama70b, llama70b_engine):  # noqa: F811
    config = R.preprocessing_config(llama70b, R.EngineInfo.read(llama70b_engine), R.TokenIds(2, 2))
    _assert_rows(config.input, upstream_io.declared(upstream_io.PREPROCESSING_INPUTS), {})
    _assert_rows(config.output, upstream_io.declared(upstream_io.PREPROCESSING_OUTPUTS), {})
    assert list(config.dynamic_batching.preferred_batch_size) == [llama70b.triton.max_batch_size]
    keys, _ = upstream_io.PREPROCESSING_PARAMETERS
    assert set(keys) <= set(config.parameters)
    assert config.parameters["multimodal_model_path"].string_value == ""
    assert config.parameters["gpt_model_path"].string_value == str(llama70b_engine.resolve())


def test_every_declared_input_has_a_twin_policy():
    """No declared input is silently ignored by accident: each is honoured, ignored on purpose, or refused."""
    declared = {r.name for r in upstream_io.declared(upstream_io.TRTLLM_INPUTS) + R.TWIN_ONLY_INPUTS}
    assert declared == twin_input_policy.known_inputs()
    parts = [
        twin_input_policy.HONOURED,
        twin_input_policy.IGNORED,
        set(twin_input_policy.OFF_WHEN),
        set(twin_input_policy.NEVER),
    ]
    assert sum(len(p) for p in parts) == len(declared)  # disjoint


def test_twin_refusal_names_the_input():
    def request(**arrays):
        return lambda name: arrays.get(name)

    assert twin_input_policy.refusal(request(input_ids=np.array([1, 2], np.int32))) is None
    neutral = dict(
        beam_width=np.array([1], np.int32),
        return_log_probs=np.array([False]),
        repetition_penalty=np.array([1.0], np.float32),
        min_tokens=np.array([1], np.int32),
        retention_decode_priority=np.array([90], np.int32),
        lora_weights=np.zeros((0, 0), np.float16),
    )
    assert twin_input_policy.refusal(request(**neutral)) is None
    why = twin_input_policy.refusal(request(presence_penalty=np.array([0.5], np.float32)))
    assert why.startswith("presence_penalty: the CPU twin serves only presence_penalty=0.0") and "[0.5]" in why
    why = twin_input_policy.refusal(request(prompt_embedding_table=np.zeros((1, 2, 4), np.float16)))
    assert why.startswith("prompt_embedding_table: prompt tuning is not supported by the CPU twin")
    assert twin_input_policy.refusal(request(guided_decoding_guide=np.array([b"{}"], object))) is None  # honoured
