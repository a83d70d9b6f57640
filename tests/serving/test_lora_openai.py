"""LoRA through the OpenAI twin over real HTTP: adapters listed by /v1/models and selected by ``model`` or by
trtllm-serve's ``lora_request``; greedy text equal to peft's greedy on transformers in float64, alone and in one
concurrent batch mixing three adapters and the base; a ``lora_path`` not configured is read on demand; every bad
request is a 400 naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from lora_adapters import make_adapter, make_all, peft_model
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]
NAME = "stories-lora"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big"]
N = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    return make_all(stories_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def served(stories_dir, adapters):
    from trtpipe.serving.adapters import LoraSettings
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    configured = {k: v for k, v in adapters.items() if k != "r64-attn-rslora"}  # that one comes by lora_path
    model = ServedModel(
        stories_dir, NAME, lora=LoraSettings(configured, max_lora_rank=64, max_loras=2, max_cpu_loras=4)
    )
    with serve_in_thread(OpenAIServer(model).app) as url:
        yield url, model


@pytest.fixture(scope="module")
def peft_text(stories_dir, adapters):
    """peft on transformers in float64: greedy text of N new tokens (the base model for None)."""
    from transformers import AutoTokenizer

    from numerics import hf_float64
    from trtpipe.models.synthetic import load_hf

    tok = AutoTokenizer.from_pretrained(stories_dir)
    models = {n: peft_model(stories_dir, p) for n, p in adapters.items()}
    models[None] = hf_float64(load_hf(stories_dir))

    def run(lora, prompt: str) -> str:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = models[lora].generate(
                torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        new = out[0, len(ids) :].tolist()
        return tok.decode(new[: new.index(2)] if 2 in new else new)

    return run


def _complete(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"max_tokens": N, "temperature": 0, **body}, timeout=120)


def test_models_lists_base_and_adapters(served):
    url, _ = served
    ids = [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]]
    assert ids[0] == NAME and set(ids[1:]) == {"r8-attn", "r64-all", "r8-all-rslora"}


@pytest.mark.parametrize("lora", ["r8-attn", "r64-all", "r8-all-rslora", None])
def test_greedy_text_equals_peft(served, peft_text, lora):
    url, _ = served
    for prompt in PROMPTS[:2]:
        r = _complete(url, model=lora or NAME, prompt=prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == peft_text(lora, prompt), (lora, prompt)


def test_lora_request_selects_and_loads_on_demand(served, peft_text, adapters):
    """trtllm-serve's lora_request: a configured adapter by name, and one that is not configured by its lora_path
    (read, checked and served; listed afterwards)."""
    url, model = served
    r = _complete(url, model=NAME, prompt=PROMPTS[0], lora_request={"lora_name": "r64-all", "lora_int_id": 1})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == peft_text("r64-all", PROMPTS[0])
    req = {"lora_name": "r64-attn-rslora", "lora_int_id": 7, "lora_path": str(adapters["r64-attn-rslora"])}
    r = _complete(url, model=NAME, prompt=PROMPTS[1], lora_request=req)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == peft_text("r64-attn-rslora", PROMPTS[1])
    assert "r64-attn-rslora" in [m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]]


def test_mixed_concurrent_batch_equals_solo(served, peft_text):
    """Eight requests at once over three adapters and the base (max_loras 2: the executor holds at most two
    adapters per step and cycles the rest): each text equals peft's greedy, as its solo request does."""
    url, model = served
    jobs = [(lora, p) for lora in ("r8-attn", "r64-all", None, "r8-all-rslora") for p in PROMPTS[2:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _complete(url, model=j[0] or NAME, prompt=j[1]), jobs))
    for (lora, prompt), r in zip(jobs, got):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == peft_text(lora, prompt), (lora, prompt)
    assert model.adapters.stats.device_evictions > 0  # more adapters than max_loras went through


def test_bad_adapter_requests_are_400(served, tmp_path):
    url, _ = served
    from trtpipe.models.synthetic import make_synthetic

    other = make_adapter(make_synthetic("llama", tmp_path / "other"), tmp_path / "oa", 8, 16, ("gate_proj",), False, 3)
    cases = [
        (dict(model="nope"), "model", "The model `nope` does not exist"),
        (
            dict(lora_request={"lora_name": "x", "lora_int_id": 9, "lora_path": str(tmp_path / "none")}),
            "lora_request",
            "does not exist",
        ),
        (
            dict(model="r8-attn", lora_request={"lora_name": "r64-all", "lora_int_id": 1}),
            "lora_request",
            "names adapter",
        ),
        (
            dict(lora_request={"lora_name": "y", "lora_int_id": 11, "lora_path": str(other)}),
            "lora_request",
            "do not fit the base",
        ),
        (dict(lora_request={"lora_name": "z", "lora_int_id": 12}), "lora_request", "not served and no lora_path"),
        (dict(lora_request={"lora_name": "r8-attn"}), "lora_request", "lora_int_id"),
    ]
    for extra, param, text in cases:
        r = _complete(url, prompt=PROMPTS[0], **{"model": NAME, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], (extra, err)
