"""The OpenAI-compatible twin of trtllm-serve, queried over real HTTP (127.0.0.1) with the official ``openai``
client: completions and chat, streaming and not, ``usage``, stop strings, errors, /v1/models, /health, /metrics.
The model is stories260k exported in float16 by the llmapi export; greedy text must equal transformers' greedy
``generate`` on the same float16 checkpoint (both compute in float32), also with 8 requests in flight at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

NAME = "stories-twin"
TEMPLATE = (Path(__file__).parent / "data" / "chat_template.jinja").read_text()
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big"]


@pytest.fixture(scope="module")
def fp16_export(stories_fp16_export):
    return stories_fp16_export


@pytest.fixture(scope="module")
def server(fp16_export):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    served = ServedModel(fp16_export, NAME, chat_template=TEMPLATE)
    with serve_in_thread(OpenAIServer(served).app) as url:
        yield url, served


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_greedy(fp16_export):
    """transformers' greedy continuation of token ids (float16 weights, float32 compute), new tokens only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp16_export, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id

    def run(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )
        new = out[0, len(ids) :].tolist()
        return new[: new.index(eos)] if eos in new else new

    return run


def _tok(server):
    return server[1].tokenizer


def test_models_health_metrics(server, client):
    import json
    import urllib.request

    assert [m.id for m in client.models.list().data] == [NAME]
    with urllib.request.urlopen(server[0] + "/health") as r:
        assert r.status == 200 and r.read() == b""
    client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    with urllib.request.urlopen(server[0] + "/metrics") as r:
        stats = json.loads(r.read())
    assert stats and {"iter", "numActiveRequests", "kvCacheStats", "inflightBatchingStats"} <= set(stats[0])
    with urllib.request.urlopen(server[0] + "/prometheus/metrics") as r:
        text = r.read().decode()
    assert "trtllm_request_success_total{" in text and "trtllm_generation_tokens_total{" in text
    # trtllm-serve's histograms with its buckets: cumulative, +Inf == _count == the finished requests
    done = sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("trtllm_request_success_total{")
    )
    for name in (
        "trtllm_time_to_first_token_seconds",
        "trtllm_e2e_request_latency_seconds",
        "trtllm_time_per_output_token_seconds",
        "trtllm_request_queue_time_seconds",
    ):
        buckets = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "_bucket{")]
        count = next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "_count{"))
        assert buckets == sorted(buckets) and buckets[-1] == count, name
        assert count == done or (name == "trtllm_time_per_output_token_seconds" and count <= done), name
    assert (
        'trtllm_time_to_first_token_seconds_bucket{model_name="stories-twin",engine_type="trtllm",le="0.001"}' in text
    )


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_transformers(client, server, hf_greedy, prompt):
    tok = _tok(server)
    ids = tok.encode(prompt)
    want = hf_greedy(ids, 24)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)
    assert r.choices[0].finish_reason == ("length" if len(want) == 24 else "stop")


def test_completion_streaming(client, server, hf_greedy):
    tok = _tok(server)
    want = tok.decode(hf_greedy(tok.encode(PROMPTS[0]), 32), skip_special_tokens=True)
    parts, usage, finish = [], None, None
    for chunk in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == want and len([p for p in parts if p]) > 5  # really incremental
    assert usage is not None and usage.completion_tokens == 32 and finish == "length"


def test_chat_equals_transformers_on_the_template(client, server, hf_greedy):
    tok = _tok(server)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    want = tok.decode(hf_greedy(ids, 20), skip_special_tokens=True)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_concurrent_requests_match_sequential(client, server, hf_greedy):
    """8 streams in flight together (in-flight batching) give each its own greedy text."""
    tok = _tok(server)
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    want = [tok.decode(hf_greedy(tok.encode(p), 16), skip_special_tokens=True) for p in prompts]

    def one(p):
        return "".join(
            c.choices[0].text
            for c in client.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0, stream=True)
            if c.choices
        )

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert got == want


def test_stop_string(client, server, hf_greedy):
    tok = _tok(server)
    full = tok.decode(hf_greedy(tok.encode(PROMPTS[0]), 40), skip_special_tokens=True)
    assert "." in full
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=["."])
    assert r.choices[0].text == full[: full.index(".")] and r.choices[0].finish_reason == "stop"


def test_errors(client, server, hf_greedy):
    import openai

    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="TLLM_ALLOW_N_GREEDY_DECODING"):  # greedy n > 1, as upstream
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    # A seed past uint64 used to kill the executor thread (every later request hung): now a 400, and the server serves.
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=1, seed=1 << 64)
    tok = _tok(server)
    want = hf_greedy(tok.encode(PROMPTS[0]), 16)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
