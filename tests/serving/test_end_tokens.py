"""A model's end tokens as TensorRT-LLM's ``SamplingParams._setup`` sets them up (trtpipe/serving/end_tokens.py):
the tokenizer's end id, and every other id of ``generation_config.eos_token_id`` a stop token, through each front
end's request builder (the OpenAI twin's is exercised over HTTP in tests/export/test_openai_end_tokens.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtpipe.errors import ServingError
from trtpipe.serving.api import FinishReason, Response
from trtpipe.serving.dynamo_requests import RequestRefused, translate
from trtpipe.serving.end_tokens import EndTokens, end_tokens, read_end_tokens
from trtpipe.serving.llmapi_adapter import drop_stop_token, request_of

GPT_OSS_EOS = [200002, 199999, 200012]  # gpt-oss generation_config.json: <|return|>, <|endoftext|>, <|call|>


def test_gpt_oss_every_eos_id_ends_the_request():
    ends = end_tokens(GPT_OSS_EOS, tokenizer_eos=200002)
    assert ends == EndTokens(200002, (199999, 200012))
    assert ends.for_request() == (200002, (199999, 200012))
    # a request's own stop ids come first, each once, never the end id
    assert ends.for_request(stop_token_ids=[5, 200012, 200002, 5]) == (200002, (5, 200012, 199999))
    # ignore_eos: no model end token at all; the request's own stop ids still stop it
    assert ends.for_request(ignore_eos=True, stop_token_ids=[5]) == (None, (5,))


def test_the_tokenizer_end_id_wins_over_the_generation_config_order():
    # Llama-3.1 Instruct: tokenizer eos <|eot_id|> 128009, generation_config [128001, 128008, 128009]
    assert end_tokens([128001, 128008, 128009], 128009) == EndTokens(128009, (128001, 128008))
    assert end_tokens([7, 9], None) == EndTokens(7, (9,))  # no tokenizer end id: the first
    assert end_tokens([], 2) == EndTokens(2, ())


def test_read_end_tokens(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": GPT_OSS_EOS}))
    assert read_end_tokens(tmp_path, 200002) == EndTokens(200002, (199999, 200012))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert read_end_tokens(tmp_path, 2) == EndTokens(2, (4,))
    (tmp_path / "generation_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 6]}))
    assert read_end_tokens(tmp_path) == EndTokens(3, (6,))  # no tokenizer, no generation config: config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ServingError, match=r"generation_config.json: eos_token_id must be a token id"):
        read_end_tokens(tmp_path, 2)


def test_dynamo_request_stops_on_every_eos_token_id():
    req = translate({"token_ids": [1, 2], "eos_token_ids": GPT_OSS_EOS}, eos_id=200002, max_seq_len=64)
    assert req.end_id == 200002 and req.stop_words == [[199999], [200012]]
    req = translate({"token_ids": [1, 2]}, eos_id=EndTokens(200002, (199999, 200012)), max_seq_len=64)
    assert req.end_id == 200002 and req.stop_words == [[199999], [200012]]  # the worker's own, when none is sent
    ignored = {"token_ids": [1, 2], "eos_token_ids": GPT_OSS_EOS, "stop_conditions": {"ignore_eos": True}}
    req = translate(ignored, eos_id=200002, max_seq_len=64)
    assert req.end_id is None and req.stop_words == []
    with pytest.raises(RequestRefused, match="eos_token_ids: eos_token_id must be"):
        translate({"token_ids": [1, 2], "eos_token_ids": ["x"]}, eos_id=2, max_seq_len=64)


def test_triton_llmapi_request_stops_on_the_other_eos_ids():
    def get(name):
        return {"sampling_param_max_tokens": np.array([[8]])}.get(name)

    end_id, stop_ids = EndTokens(200002, (199999, 200012)).for_request()
    req = request_of(get, [1, 2, 3], end_id, False, stop_ids)
    assert req.end_id == 200002 and req.stop_words == [[199999], [200012]]
    tokens = [11, 12, 200012]
    drop_stop_token(tokens, Response(request_id=1, tokens=[], is_final=False), stop_ids)
    assert tokens == [11, 12, 200012]  # not final yet
    drop_stop_token(
        tokens, Response(request_id=1, tokens=[], is_final=True, finish_reason=FinishReason.LENGTH), stop_ids
    )
    assert tokens == [11, 12, 200012]  # ended by length on it: kept
    drop_stop_token(
        tokens, Response(request_id=1, tokens=[], is_final=True, finish_reason=FinishReason.STOP_WORDS), stop_ids
    )
    assert tokens == [11, 12]
