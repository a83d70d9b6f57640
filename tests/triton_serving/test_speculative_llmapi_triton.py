"""Speculative decoding of a ``target: llmapi`` recipe served by a real tritonserver through the twin of TensorRT-LLM's
Triton ``llmapi`` model (``model_repo/llmapi/1/model.py``, inputs and outputs of upstream's
``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d2``), on the executor the recipe configures.

Three servers of stories260k (float32, as stored): no speculation, NGram (k 3, n-gram 2), DraftTarget with the model
as its own draft (k 3). Shown:
- greedy ``text_output`` identical with and without speculation over a prompt set, for both kinds;
- ``acceptance_rate``, ``total_accepted_draft_tokens``, ``total_draft_tokens`` (with
  ``sampling_param_return_perf_metrics``) equal the traces worked out from the tokens: the model as its own draft
  accepts all 14 drafts of 20 tokens (by hand); NGram's counts equal a replay of its drafting rule
  (:func:`trtpipe.serving.speculative.ngram_draft`, the earliest continuation of the longest recurring suffix) over
  the plain greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.llmapi_repo import write_llmapi_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

K, NGRAM = 3, 2
N = 20  # new tokens of the acceptance checks (no end id within them: asserted)
PROMPTS = [
    "Once upon a time",
    "Lily wanted to",
    "Tom had a big red ball.",
    "One day, a cat saw a bird",
    "The sun was shining and the birds were singing. The sun was",
]
KINDS = {
    "plain": (),
    "NGram": ("speculative.decoding_type=NGram", f"speculative.max_matching_ngram_size={NGRAM}"),
    "DraftTarget": ("speculative.decoding_type=DraftTarget",),
}


@pytest.fixture(scope="module")
def served(stories_dir, stories_recipe, tmp_path_factory):
    """kind -> a tritonserver of the llmapi twin; and the plain executor config (for the in-process replay)."""
    from contextlib import ExitStack

    from trtpipe.serving.config import from_recipe, to_json

    root = tmp_path_factory.mktemp("spec_llmapi")
    configs = {}
    with ExitStack() as stack:
        servers = {}
        for kind, extra in KINDS.items():
            draft = (f"speculative.speculative_model={stories_dir}",) if kind == "DraftTarget" else ()
            recipe = stories_recipe("target=llmapi", f"speculative.max_draft_len={K}", *extra, *draft)
            configs[kind] = from_recipe(recipe, 512)
            write_llmapi_repo(recipe, root / kind, str(stories_dir), twin_executor_config=to_json(configs[kind]))
            servers[kind] = stack.enter_context(start_server(root / kind, timeout=240))
        yield servers, configs


def _generate(server, prompt: str, max_tokens: int) -> dict:
    import tritonclient.grpc as grpcclient

    from trtpipe.triton.client import infer_inputs

    rows = [
        ("text_input", np.array([prompt.encode()], dtype=object), "BYTES"),
        ("sampling_param_max_tokens", np.array([max_tokens], np.int32), "INT32"),
        ("sampling_param_return_perf_metrics", np.array([True]), "BOOL"),
        ("return_finish_reason", np.array([True]), "BOOL"),
    ]
    names = ("text_output", "finish_reason", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        r = raw.infer(
            "tensorrt_llm", infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
        )
    got = {x: r.as_numpy(x).reshape(-1)[0] for x in names}
    got["text_output"], got["finish_reason"] = got["text_output"].decode(), got["finish_reason"].decode()
    return got


def test_the_repository_configures_the_twin_with_the_recipe(served):
    import json

    import tritonclient.grpc as grpcclient

    servers, _ = served
    with grpcclient.InferenceServerClient(servers["NGram"].grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    cfg = json.loads(params["twin_executor_config"]["string_value"])
    assert (cfg["speculative_decoding_type"], cfg["max_draft_len"], cfg["max_matching_ngram_size"]) == ("NGram", K, 2)


@pytest.mark.parametrize("kind", ["NGram", "DraftTarget"])
def test_greedy_text_identical_with_and_without_speculation(served, kind):
    servers, _ = served
    for prompt in PROMPTS:
        plain = _generate(servers["plain"], prompt, 40)
        assert len(plain["text_output"]) > 40, plain  # a story, not an early end
        spec = _generate(servers[kind], prompt, 40)
        assert spec["text_output"] == plain["text_output"], prompt
        assert spec["finish_reason"] == plain["finish_reason"]
    assert plain["total_draft_tokens"] == 0 and plain["acceptance_rate"] == 0.0


def _plain_tokens(stories_dir, config, prompt: str) -> tuple[list[int], list[int]]:
    """(prompt ids, the N greedy tokens) from the executor without speculation, in this process."""
    from transformers import AutoTokenizer

    from trtpipe.runtime.hf_loader import load_hf_checkpoint
    from trtpipe.serving.api import Request
    from trtpipe.serving.executor import ExecutorCore
    from trtpipe.serving.reference_engine import ReferenceEngine

    ids = AutoTokenizer.from_pretrained(str(stories_dir))(prompt).input_ids
    final = {}
    core = ExecutorCore(
        config,
        ReferenceEngine(load_hf_checkpoint(stories_dir)),
        lambda r: final.setdefault(r.request_id, r) if r.is_final else None,
    )
    rid = core.submit(Request(ids, N, end_id=2, exclude_input_from_output=True))
    core.run_until_idle()
    return ids, final[rid].tokens


def _ngram_trace(prompt: list[int], out: list[int], k: int, n: int) -> tuple[int, int]:
    """(drafts, accepted) of NGram over a request whose greedy output is ``out``: the context step gives token 1;
    each step drafts ngram_draft(sequence, min(k, tokens left - 1)), keeps the drafts that equal the output, then
    one target token."""
    from trtpipe.serving.speculative import ngram_draft

    done, drafts, accepted = 1, 0, 0
    while done < len(out):
        room = min(k, len(out) - done - 1)
        d = ngram_draft(prompt + out[:done], room, n) if room > 0 else []
        a = 0
        while a < len(d) and d[a] == out[done + a]:
            a += 1
        drafts, accepted, done = drafts + len(d), accepted + a, done + a + 1
    return drafts, accepted


def test_acceptance_outputs_equal_the_traces(served, stories_dir):
    servers, configs = served
    # by hand: [9 5] and [9 5 6] have no recurring suffix; [9 5 6 5] finds [5] at 1 and drafts [6 5] (2 tokens left
    # to draft), both right, and the target adds the last 6
    assert _ngram_trace([9], [5, 6, 5, 6, 5, 6], 3, 2) == (2, 2)
    total = 0
    for prompt in PROMPTS:
        ids, out = _plain_tokens(stories_dir, configs["plain"], prompt)
        assert len(out) == N and 2 not in out, out  # no end id: every trace runs the full N tokens
        drafts, accepted = _ngram_trace(ids, out, K, NGRAM)
        got = _generate(servers["NGram"], prompt, N)
        assert (got["total_draft_tokens"], got["total_accepted_draft_tokens"]) == (drafts, accepted), prompt
        assert got["acceptance_rate"] == pytest.approx(accepted / drafts if drafts else 0.0)
        total += drafts
        own = _generate(servers["DraftTarget"], prompt, N)
        assert (own["total_draft_tokens"], own["total_accepted_draft_tokens"], own["acceptance_rate"]) == (14, 14, 1.0)
    assert total > 0  # the prompt set makes n-gram drafts
