"""The OpenAI twin's logprobs, echo, token-id prompts, n / best_of, ignore_eos and min_tokens over real HTTP, with
the official ``openai`` client where it has the field. Logprobs must equal transformers' float64 log-softmax on the
same weights (stories260k, float32 checkpoint) within ``ORDER_FACTOR`` x the float32 error scale of transformers'
own float32 log-softmax (tests/numerics.py); streamed logprobs must join to the non-streamed ones."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch
from numerics import ORDER_FACTOR, U32, error_scale
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

NAME = "stories-logprobs"
TEMPLATE = (Path(__file__).parent / "data" / "chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def server(stories_dir):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    served = ServedModel(stories_dir, NAME, chat_template=TEMPLATE)
    with serve_in_thread(OpenAIServer(served).app) as url:
        yield url, served


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(stories_dir):
    """ids -> (float64 log-softmax [L, V], tolerance) of transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    hf64 = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float64).eval()

    @torch.no_grad()
    def run(ids: list[int]):
        lp64 = torch.log_softmax(hf64(torch.tensor([ids])).logits[0].double(), -1)
        lp32 = torch.log_softmax(hf32(torch.tensor([ids])).logits[0].float(), -1)
        return lp64, ORDER_FACTOR * error_scale(lp32, lp64, U32)

    return run


def _post(url: str, path: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, (json.loads(text) if not body.get("stream") else text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _ids(server, text: str) -> list[int]:
    return server[1].tokenizer.encode(text)


def test_completion_logprobs_shape_and_echo_agree(server, client, reference):
    """The sampled tokens' logprobs (each against float64 in tests/serving/test_logprobs.py) in OpenAI's shape: the
    pieces join to the text, offsets count their characters, and echo adds the prompt before the same tokens."""
    prompt = "Once upon a time"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0.8, seed=3, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert len(lp.token_logprobs) == r.usage.completion_tokens == 12
    for chosen, piece, top in zip(lp.token_logprobs, lp.tokens, lp.top_logprobs):
        assert top[piece] == chosen and len(top) in (3, 4) and chosen <= max(top.values())
    ids = _ids(server, prompt)
    status, body = _post(
        server[0],
        "/v1/completions",
        {"prompt": ids, "max_tokens": 12, "temperature": 0.8, "seed": 3, "logprobs": 3, "echo": True},
    )
    e = body["choices"][0]
    assert e["text"] == server[1].tokenizer.decode(ids, skip_special_tokens=False) + r.choices[0].text
    assert e["logprobs"]["tokens"][len(ids) :] == lp.tokens  # same seed: the same tokens
    _, tol = reference(ids)
    # the same values up to float32 rounding (the echo request's step puts more rows through the LM head)
    assert all(abs(a - b) <= tol for a, b in zip(e["logprobs"]["token_logprobs"][len(ids) :], lp.token_logprobs))
    assert "".join(e["logprobs"]["tokens"]) == e["text"]


def test_echo_on_lists_of_token_ids_scores_every_prompt(server, reference):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    prompts = [[1, 403, 407, 261, 378, 261], [1, 300, 403], [1, 365]]
    status, body = _post(
        server[0],
        "/v1/completions",
        {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234},
    )
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for p, c in zip(prompts, body["choices"]):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(p) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        lp64, tol = reference(p)
        for i in range(1, len(p)):
            assert abs(lp["token_logprobs"][i] - float(lp64[i - 1, p[i]])) <= tol
            greedy = int(lp64[i - 1].argmax()) == p[i]
            assert (lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())) == greedy or (
                abs(float(lp64[i - 1].topk(2).values.diff().abs())) <= 2 * tol  # a float32 tie
            )
        assert abs(lp["token_logprobs"][-1] - float(lp64[-1].max())) <= tol  # greedy: the largest logprob


def test_streamed_logprobs_join_to_the_non_streamed(server):
    body = {"prompt": [1, 403, 407], "max_tokens": 16, "logprobs": 2, "echo": True, "temperature": 0.9, "seed": 7}
    whole = _post(server[0], "/v1/completions", body)[1]["choices"][0]
    text = _post(server[0], "/v1/completions", {**body, "stream": True})[1]
    parts = [c for ev in _events(text) for c in ev["choices"]]
    assert "".join(c["text"] for c in parts) == whole["text"]
    joined = {k: [x for c in parts if c["logprobs"] for x in c["logprobs"][k]] for k in whole["logprobs"]}
    assert joined == whole["logprobs"]
    # with a stop string the stream holds back the text (and its tokens' logprobs) a stop may still cut
    stop = whole["text"][len("<s> Once upon") + 3 : len("<s> Once upon") + 8]
    cut = _post(server[0], "/v1/completions", {**body, "stop": [stop]})[1]["choices"][0]
    streamed = _events(_post(server[0], "/v1/completions", {**body, "stop": [stop], "stream": True})[1])
    parts = [c for ev in streamed for c in ev["choices"]]
    assert "".join(c["text"] for c in parts) == cut["text"] and stop not in cut["text"]
    assert [x for c in parts if c["logprobs"] for x in c["logprobs"]["tokens"]] == cut["logprobs"]["tokens"]
    assert len(cut["logprobs"]["tokens"]) < len(whole["logprobs"]["tokens"])


def test_chat_logprobs_streamed_and_not(server, client, reference):
    messages = [{"role": "user", "content": "Tell me a story."}]
    r = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    parts = []
    for ch in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, stream=True
    ):
        if ch.choices and ch.choices[0].logprobs:
            parts += ch.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in parts] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_independent_seeded_samples(server, client, monkeypatch):
    prompt = "One day, a big"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=4)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len(set(texts)) > 1, texts  # independent samples, not one text four times
    for i, t in enumerate(texts):  # choice i is the request seeded seed + i
        one = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=11 + i)
        assert one.choices[0].text == t
    # several prompts: index = prompt * n + i
    r = client.completions.create(model=NAME, prompt=[[1, 403], [1, 300]], max_tokens=4, temperature=1.0, seed=2, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    # greedy n > 1: refused as upstream refuses it, unless TLLM_ALLOW_N_GREEDY_DECODING is set
    status, body = _post(server[0], "/v1/completions", {"prompt": prompt, "max_tokens": 8, "n": 3, "temperature": 0})
    assert status == 400 and "TLLM_ALLOW_N_GREEDY_DECODING" in body["error"]["message"]
    monkeypatch.setenv("TLLM_ALLOW_N_GREEDY_DECODING", "1")
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, n=3, temperature=0)
    assert len({c.text for c in r.choices}) == 1 and len(r.choices) == 3


def test_best_of_returns_the_highest_cumulative_logprob(server):
    body = {"prompt": "Lily and Tom", "max_tokens": 10, "temperature": 1.2, "seed": 5, "logprobs": 0}
    every = _post(server[0], "/v1/completions", {**body, "n": 4})[1]["choices"]
    cum = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    status, got = _post(server[0], "/v1/completions", {**body, "n": 2, "best_of": 4})
    assert status == 200, got
    order = sorted(range(4), key=lambda i: -cum[i])[:2]
    assert [c["text"] for c in got["choices"]] == [every[i]["text"] for i in order]
    status, body = _post(server[0], "/v1/completions", {**body, "n": 3, "best_of": 2})
    assert status == 400 and "best_of (2) cannot be less than n (3)" in body["error"]["message"]


@pytest.fixture(scope="module")
def comma_server(stories_dir, tmp_path_factory):
    """stories260k whose end id is the comma (its tokenizer's eos_token and its generation_config say so, as
    TensorRT-LLM takes the end id from the tokenizer: trtpipe/serving/end_tokens.py): stories260k itself practically
    never samples its end id (log-probability about -22 even after "The end."), a comma comes within a few tokens."""
    import shutil

    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    d = tmp_path_factory.mktemp("comma")
    for f in stories_dir.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    served = ServedModel(d, NAME)
    comma = served.tokenizer.convert_tokens_to_ids(",")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": comma}))
    tok_config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tok_config, "eos_token": ","}))
    served.shutdown()
    served = ServedModel(d, NAME)
    assert served.eos_id == comma
    with serve_in_thread(OpenAIServer(served).app) as url:
        yield url, served


def test_ignore_eos_and_min_tokens(comma_server):
    url, served = comma_server
    base = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 30}
    free = _post(url, "/v1/completions", base)[1]
    assert free["choices"][0]["finish_reason"] == "stop" and free["usage"]["completion_tokens"] == 0
    r = _post(url, "/v1/completions", {**base, "ignore_eos": True, "logprobs": 1})[1]
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 30
    assert r["choices"][0]["logprobs"]["tokens"][0] == ","  # (the text skips it: the tokenizer's eos is special)
    held = _post(url, "/v1/completions", {**base, "min_tokens": 4, "logprobs": 2})[1]
    lp = held["choices"][0]["logprobs"]
    assert held["usage"]["completion_tokens"] >= 4 and "," not in "".join(lp["tokens"][:4])
    assert "," in lp["top_logprobs"][0]  # the banned end id is still in the raw distribution's top


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"n": 2, "best_of": 4, "stream": True, "temperature": 1}, "best_of"),
        ("/v1/completions", {"n": 65, "temperature": 1}, "n"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
        ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, "prompt"),
    ],
)
def test_bad_values_are_400_naming_the_field(server, path, body, param):
    base = {"max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    status, out = _post(server[0], path, {**base, **body})
    assert status == 400 and out["error"]["param"] == param, out


def test_stop_token_ids_and_include_stop_str_in_output(server):
    url = server[0]
    comma = server[1].tokenizer.convert_tokens_to_ids(",")
    base = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 20, "logprobs": 1}
    free = _post(url, "/v1/completions", base)[1]["choices"][0]
    assert free["text"].startswith(",")  # greedy: the first token is the comma
    status, r = _post(url, "/v1/completions", {**base, "stop_token_ids": [comma]})
    assert status == 200 and r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == "" and r["usage"]["completion_tokens"] == 0
    assert r["choices"][0]["logprobs"]["tokens"] == []
    r = _post(url, "/v1/completions", {**base, "stop_token_ids": [comma], "include_stop_str_in_output": True})[1]
    assert r["choices"][0]["text"] == "," and r["choices"][0]["logprobs"]["tokens"] == [","]
    stop = free["text"][4:9]
    r = _post(url, "/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True})[1]
    assert r["choices"][0]["text"] == free["text"][: free["text"].index(stop) + len(stop)]
    streamed = _post(url, "/v1/completions", {**base, "stop_token_ids": [comma], "stream": True})[1]
    assert "".join(c["text"] for ev in _events(streamed) for c in ev["choices"]) == ""
    status, r = _post(url, "/v1/completions", {**base, "stop_token_ids": [10**6]})
    assert status == 400 and r["error"]["param"] == "stop_token_ids"


def test_temperature_defaults_to_one_as_trtllm_serve(client):
    """A request without ``temperature`` samples at 1.0 with ``top_p`` 1.0, as trtllm-serve's
    ``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params`` default them (openai_protocol.py@0076e939):
    the same texts as ``temperature: 1.0`` under the same seed, and n choices that differ."""
    prompt, kw = "One day, a big", {"model": NAME, "max_tokens": 12, "seed": 11, "n": 4}

    def texts(r):
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    omitted = texts(client.completions.create(prompt=prompt, **kw))
    assert omitted == texts(client.completions.create(prompt=prompt, temperature=1.0, **kw))
    assert len(set(omitted)) > 1, omitted
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(messages=messages, **kw)
    chat_t1 = client.chat.completions.create(messages=messages, temperature=1.0, top_p=1.0, **kw)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in chat_t1.choices]
