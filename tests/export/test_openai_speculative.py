"""Speculative decoding through the OpenAI twin: greedy text identical with and without it over a prompt set, the
acceptance in each response's ``usage`` (TensorRT-LLM's names) and in the Prometheus counters, which sum it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from openai_helpers import serve_in_thread

NAME = "stories-spec"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. Lily and Tom went to the",
    "One day, a big",
    "The cat sat. The cat sat. The cat",
]
SPEC = {
    "off": {},
    "ngram": {"speculative_decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2},
    "self-draft": {"speculative_decoding_type": "DraftTarget", "max_draft_len": 3},
}


@pytest.fixture(scope="module")
def servers(stories_fp16_export):
    from contextlib import ExitStack

    from trtpipe.serving.config import replace_knobs, twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    out = {}
    with ExitStack() as stack:
        for name, knobs in SPEC.items():
            if name == "self-draft":
                knobs = {**knobs, "speculative_model": str(stories_fp16_export)}  # the model as its own draft
            config = replace_knobs(twin_default(512), **knobs)
            served = ServedModel(stories_fp16_export, NAME, config)
            stack.callback(served.shutdown)
            out[name] = stack.enter_context(serve_in_thread(OpenAIServer(served).app))
        yield out


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _counter(url: str, name: str) -> int:
    text = urllib.request.urlopen(url + "/prometheus/metrics", timeout=30).read().decode()
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")))


@pytest.mark.slow
def test_greedy_text_identical_and_acceptance_visible(servers):
    got = {name: [] for name in servers}
    for prompt in PROMPTS:
        for name, url in servers.items():
            got[name].append(_post(url, {"model": NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0}))
    for name in ("ngram", "self-draft"):
        drafts = accepted = 0
        for plain, spec in zip(got["off"], got[name]):
            assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
            assert "speculative_decoding" not in plain["usage"]
            s = spec["usage"]["speculative_decoding"]
            d = spec["usage"]["completion_tokens_details"]
            assert d["accepted_prediction_tokens"] == s["total_accepted_draft_tokens"]
            assert d["rejected_prediction_tokens"] == s["total_draft_tokens"] - s["total_accepted_draft_tokens"]
            if name == "self-draft":
                assert s["total_draft_tokens"] > 0 and s["acceptance_rate"] == 1.0
            drafts += s["total_draft_tokens"]
            accepted += s["total_accepted_draft_tokens"]
        url = servers[name]
        assert _counter(url, "trtllm_spec_decode_draft_tokens_total") == drafts > 0
        assert _counter(url, "trtllm_spec_decode_accepted_tokens_total") == accepted > 0
