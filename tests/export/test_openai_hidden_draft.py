"""An EAGLE-3 recipe end to end: the trtllm-serve YAML, the Triton llmapi model.yaml and the Dynamo worker arguments
carry the ``speculative_config`` whose head the OpenAI twin then executes (the same ExecutorConfig, from the recipe):
completion text identical with and without it, acceptance in ``usage`` and in the Prometheus counters.

The target is stories260k deepened to 8 layers (its layers 2-4 repeated: upstream's default EAGLE-3 capture needs
more than 5), so that it keeps its tokenizer; the head is random (trtpipe.models.synthetic_heads)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from openai_helpers import serve_in_thread

NAME = "stories-eagle3"
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park.", "One day, a big"]
RECIPE = """\
name: eagle
target: llmapi
model:
  source: {model}
engine:
  gpu: h100-sxm-80gb
  max_batch_size: 4
  max_input_len: 256
  max_seq_len: 512
  max_num_tokens: 2048
accuracy:
  enabled: false
speculative:
  decoding_type: Eagle3
  max_draft_len: 3
  eagle3_one_model: true
  speculative_model: {head}
"""


@pytest.fixture(scope="module")
def deep(tmp_path_factory, stories_dir):
    from trtpipe.models.synthetic_heads import deepened_llama, make_eagle3_head

    root = tmp_path_factory.mktemp("eagle3-e2e")
    d = deepened_llama(stories_dir, root / "stories-8l")
    head = make_eagle3_head(d, root / "head", seed=4)
    recipe = root / "eagle.yaml"
    recipe.write_text(RECIPE.format(model=d, head=head))
    return d, head, recipe


def test_the_artifacts_carry_what_the_twin_executes(deep):
    from trtpipe.app.validation import check_recipe, load_recipe
    from trtpipe.deploy.dynamo import ROLES, engine_options
    from trtpipe.export.serving import llm_api_options, model_yaml
    from trtpipe.serving.config import from_recipe

    d, head, path = deep
    r = load_recipe(path)
    assert check_recipe(r) == []
    spec = {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": str(head), "eagle3_one_model": True}
    assert llm_api_options(r, "1.2")["speculative_config"] == spec  # trtllm-serve's extra_llm_api_options
    assert model_yaml(r, str(d))["speculative_config"] == spec  # the Triton llmapi model
    for role in ROLES:
        assert engine_options(r, role)["speculative_config"] == spec, role  # the Dynamo worker
    c = from_recipe(r, 512)
    assert (c.speculative_decoding_type, c.max_draft_len, c.speculative_model) == ("Eagle3", 3, str(head))


@pytest.fixture(scope="module")
def servers(deep):
    from contextlib import ExitStack

    from trtpipe.app.validation import load_recipe
    from trtpipe.serving.config import from_recipe, replace_knobs
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    d, _, path = deep
    on = from_recipe(load_recipe(path), 512)
    off = replace_knobs(on, speculative_decoding_type="", max_draft_len=0, speculative_model="")
    out = {}
    with ExitStack() as stack:
        for name, config in (("off", off), ("eagle3", on)):
            served = ServedModel(d, NAME, config)
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
def test_eagle3_through_the_openai_twin_keeps_greedy_text(servers):
    drafts = accepted = 0
    for prompt in PROMPTS:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        plain, spec = _post(servers["off"], body), _post(servers["eagle3"], body)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        s = spec["usage"]["speculative_decoding"]
        assert s["total_draft_tokens"] > 0 and 0 <= s["total_accepted_draft_tokens"] <= s["total_draft_tokens"]
        drafts += s["total_draft_tokens"]
        accepted += s["total_accepted_draft_tokens"]
    assert _counter(servers["eagle3"], "trtllm_spec_decode_draft_tokens_total") == drafts
    assert _counter(servers["eagle3"], "trtllm_spec_decode_accepted_tokens_total") == accepted
