"""An EAGLE-3 static tree end to end through the OpenAI twin (the trtllm-serve stand-in): the recipe's
``speculative.eagle_choices`` (two-model, as upstream drafts trees) becomes the executor config the twin serves;
greedy completion text is identical with and without it, and ``usage`` reports the drafts (every tree node) and the
accepted ones, as do the Prometheus counters. The target is stories260k deepened to 8 layers, the head trained on its
own text (trtpipe.models.synthetic_heads.train_eagle3_head), so drafts are accepted. The same through EAGLE-2's
dynamic tree (``use_dynamic_tree``, one-model as upstream runs it, llmapi 1.3: trtpipe/serving/dynamic_tree.py)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from eagle3_trees import PROMPTS, RECIPE, SPECS, TREE
from openai_helpers import serve_in_thread

NAME = "stories-eagle3-tree"


@pytest.fixture(scope="module", params=list(SPECS))
def servers(request, tmp_path_factory, stories_dir):
    from contextlib import ExitStack

    from trtpipe.app.validation import check_recipe, load_recipe
    from trtpipe.models.synthetic_heads import deepened_llama, train_eagle3_head
    from trtpipe.serving.config import from_recipe, replace_knobs
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    root = tmp_path_factory.mktemp("eagle3-tree-e2e")
    d = deepened_llama(stories_dir, root / "stories-8l")
    head, _, _ = train_eagle3_head(d, root / "head", 150, samples=256)
    path = root / "r.yaml"
    path.write_text(RECIPE.format(model=d, head=head, spec=SPECS[request.param]))
    r = load_recipe(path)
    assert check_recipe(r) == []
    on = from_recipe(r, 512)
    assert (on.eagle_choices != "") == (request.param == "static") and on.max_draft_len == len(TREE)
    assert on.dynamic_tree_max_top_k == (3 if request.param == "dynamic" else 0)
    off = replace_knobs(
        on,
        speculative_decoding_type="",
        max_draft_len=0,
        speculative_model="",
        eagle_choices="",
        dynamic_tree_max_top_k=0,
        dynamic_tree_depth=0,
    )
    out = {}
    with ExitStack() as stack:
        for name, config in (("off", off), ("tree", on)):
            served = ServedModel(d, NAME, config)
            stack.callback(served.shutdown)
            out[name] = stack.enter_context(serve_in_thread(OpenAIServer(served).app))
        yield {**out, "mode": request.param}


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
def test_an_eagle3_tree_through_the_openai_twin_keeps_greedy_text(servers):
    drafts = accepted = 0
    for prompt in PROMPTS:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        plain, spec = _post(servers["off"], body), _post(servers["tree"], body)
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
        s = spec["usage"]["speculative_decoding"]
        # the first verification drafts the whole tree (room for all of it), so at least len(TREE) drafts
        # (a dynamic tree may drop a node whose parent tied out of the best len(TREE))
        assert s["total_draft_tokens"] >= len(TREE) - (servers["mode"] == "dynamic")
        assert 0 <= s["total_accepted_draft_tokens"] <= s["total_draft_tokens"]
        drafts += s["total_draft_tokens"]
        accepted += s["total_accepted_draft_tokens"]
    assert accepted > 0  # the trained head's drafts are accepted through the server too
    assert _counter(servers["tree"], "trtllm_spec_decode_draft_tokens_total") == drafts
    assert _counter(servers["tree"], "trtllm_spec_decode_accepted_tokens_total") == accepted
    print(f"EAGLE-3 tree through the OpenAI twin: {accepted} of {drafts} drafts accepted")
