"""trtpipe's completions ingress in front of Dynamo's frontend (issue 38 item 11): a text completion's ids are
trtllm-serve's (``encode(prompt, add_special_tokens=True)``: BOS first), handed to the frontend in
``nvext.token_data``; token-id prompts, chat and everything else pass unchanged. End to end through the real
frontend, router and workers: tests/serving/test_dynamo.py."""

from __future__ import annotations

import pytest

from trtpipe.serving.dynamo_ingress import Encoder, PromptRefused, encode_completion


@pytest.fixture(scope="module")
def encoder(stories_dir):
    return Encoder(stories_dir, max_seq_len=512)


def test_a_text_prompt_gets_trtllm_serves_ids_with_bos(encoder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(encoder.tokenizer.name_or_path))
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "nvext": {"cache_salt": "x"}}
    out = encode_completion(body, encoder, encoder.refuse)
    ids = tok.encode("Once upon a time", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("Once upon a time", add_special_tokens=False)
    assert out == {**body, "nvext": {"cache_salt": "x", "token_data": ids}}
    assert body["nvext"] == {"cache_salt": "x"}  # the caller's body is not modified
    assert encode_completion({"prompt": ["Once upon a time"]}, encoder, encoder.refuse)["nvext"]["token_data"] == ids


def test_add_special_tokens_false_is_honoured_and_not_forwarded(encoder):
    out = encode_completion({"prompt": "The little dog", "add_special_tokens": False}, encoder, encoder.refuse)
    assert "add_special_tokens" not in out
    assert out["nvext"]["token_data"] == encoder("The little dog", add_special_tokens=False)
    assert out["nvext"]["token_data"][0] != encoder.tokenizer.bos_token_id


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2, 3]},  # a client's own ids: used as given, as trtllm-serve does
        {"prompt": "x", "nvext": {"token_data": [5, 6]}},  # tokenized upstream already
        {"prompt": ["a", "b"]},  # a batch: the frontend refuses it itself
        {"prompt": "x", "add_special_tokens": "yes"},  # not a bool: the frontend's 4xx
        {"prompt": "x", "nvext": "bad"},
        ["not", "an", "object"],
        {"messages": [{"role": "user", "content": "hi"}]},
    ],
)
def test_everything_else_passes_unchanged(encoder, body):
    assert encode_completion(body, encoder, encoder.refuse) is body


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(encoder):
    calls = []

    def encode(text, add_special_tokens=True):
        calls.append(text)
        return [1]

    text = "a" * (512 * encoder.max_chars_per_token)
    with pytest.raises(PromptRefused, match=r"leaves no room in max_seq_len 512"):
        encode_completion({"prompt": text}, encode, encoder.refuse)
    assert calls == []
