"""The OpenAI twin ends a request on every id of ``generation_config.eos_token_id``, not only on the first, as
TensorRT-LLM's ``SamplingParams._setup`` makes the others stop tokens (trtpipe/serving/end_tokens.py): stories260k
with ``eos_token_id: [2, <comma>]`` (2 is its tokenizer's ``</s>``, which it practically never samples; a comma comes
within a few tokens) is gpt-oss's shape, ``[<|return|>, <|endoftext|>, <|call|>]``, on a model the tests ship."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

NAME = "stories-two-eos"
PROMPT = "Once upon a time, there was"  # greedy: "a little girl named Lily. She loved ... One day, she"


@pytest.fixture(scope="module")
def two_eos(stories_dir, tmp_path_factory):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    d = tmp_path_factory.mktemp("two_eos")
    for f in stories_dir.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    served = ServedModel(d, NAME)
    comma = served.tokenizer.convert_tokens_to_ids(",")
    served.shutdown()
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, comma]}))
    served = ServedModel(d, NAME)
    with serve_in_thread(OpenAIServer(served).app) as url:
        yield url, served, comma


def _post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read().decode()
    return json.loads(text) if not body.get("stream") else text


def test_second_eos_id_ends_the_request_with_stop(two_eos):
    url, served, comma = two_eos
    base = {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 40}
    free = _post(url, "/v1/completions", {**base, "ignore_eos": True})["choices"][0]
    assert free["finish_reason"] == "length" and "," in free["text"]  # the greedy text does reach a comma
    stopped = _post(url, "/v1/completions", {**base, "logprobs": 1})["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"].strip()  # some tokens, then the comma
    assert stopped["text"] == free["text"][: free["text"].index(",")]  # ended at the comma, which is left out
    assert "," not in "".join(stopped["logprobs"]["tokens"])
    kept = _post(url, "/v1/completions", {**base, "include_stop_str_in_output": True})["choices"][0]
    assert kept["finish_reason"] == "stop" and kept["text"] == free["text"][: free["text"].index(",") + 1]
    assert (served.end_tokens.end_id, served.end_tokens.stop_ids) == (2, (comma,))


def test_second_eos_id_ends_a_stream_and_a_chat(two_eos):
    url, _, _ = two_eos
    base = {"model": NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 40}
    whole = _post(url, "/v1/completions", base)["choices"][0]
    events = [
        json.loads(x[6:])
        for x in _post(url, "/v1/completions", {**base, "stream": True}).splitlines()
        if x.startswith("data: {")
    ]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert text == whole["text"] and finish == ["stop"]
