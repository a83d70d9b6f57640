"""Speculative decoding of a recipe served by a real tritonserver through the CPU twin (engine target).

The recipe's ``speculative: {decoding_type: draft_tokens_external, speculative_model: <draft>}`` (trtllm-build's
``--speculative_decoding_mode draft_tokens_external --max_draft_len N``, ``tensorrt_llm/commands/build.py@65f1d153``)
reaches the twin's ``tensorrt_llm`` model through the repository's ``executor_extras`` parameter, and the twin runs
draft-target decoding inside that model (trtpipe/serving/speculative.py). Upstream serves the same recipe as two
Triton models, the BLS calling the draft (``tensorrt_llm_draft_model_name``) and then the target with
``draft_input_ids`` (``examples/draft_target_model/README.md@567239fc``, "using TensorRT-LLM-BLS in Triton");
trtpipe's repository does not write that two-model form (its BLS keeps ``tensorrt_llm_draft_model_name`` empty).

Shown here, target = draft = stories260k in float32 (the same weights, so the draft's argmax is the target's):
- greedy text through the ensemble and the BLS is identical with and without speculation, over a prompt set;
- the ``tensorrt_llm`` model's ``acceptance_rate``, ``total_accepted_draft_tokens`` and ``total_draft_tokens``
  (declared as in ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt@2a9abd95``, returned
  with ``return_perf_metrics``) equal the trace worked out by hand: every draft accepted.

NGram is a PyTorch-backend (``target: llmapi``) type: its Triton front is TensorRT-LLM's ``llmapi`` Python model,
which trtpipe writes for upstream's own model.py and has no twin of; the OpenAI twin serves it
(tests/export/test_openai_speculative.py).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import Client, GenerateOptions  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

K = 3  # max_draft_len
PROMPTS = [
    "Once upon a time",
    "Lily wanted to",
    "Tom had a big red ball.",
    "One day, a cat saw a bird",
    "The sun was shining and the birds were singing. The sun was",
]


def _self_draft_trace(n: int, k: int) -> tuple[int, int]:
    """(drafts, verifications) of one request of n new tokens, no end id, when every draft is accepted: the context
    step gives token 1; each verification drafts min(k, n - out - 1) and emits that many + 1."""
    out, drafts, steps = 1, 0, 0
    while out < n:
        d = min(k, n - out - 1)
        drafts, steps, out = drafts + d, steps + 1, out + d + 1
    return drafts, steps


@pytest.fixture(scope="module")
def servers(stories_dir, stories_recipe, tmp_path_factory):
    """(plain, speculative): two tritonservers on the same float32 engine, the second with the model as its own
    draft."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    root = tmp_path_factory.mktemp("spec_triton")
    engine = write_twin_engine(
        convert(stories_dir, root / "ckpt", tp=1, dtype="float32"), root / "engine", dict(BUILD_CONFIG)
    )
    base = ("model.dtype=float32", "triton.bls=true")
    spec = (
        "speculative.decoding_type=draft_tokens_external",
        f"speculative.speculative_model={stories_dir}",
        f"speculative.max_draft_len={K}",
    )
    write_repo(stories_recipe(*base), engine, engine / "checkpoint", root / "plain")
    write_repo(stories_recipe(*base, *spec), engine, engine / "checkpoint", root / "spec")
    with start_server(root / "plain", timeout=240) as plain, start_server(root / "spec", timeout=240) as s:
        yield plain, s


def test_the_repository_carries_the_draft_to_the_twin(servers):
    """The speculative server's tensorrt_llm model was configured with the recipe's draft (its executor_extras)."""
    import json

    import tritonclient.grpc as grpcclient

    _, spec = servers
    with grpcclient.InferenceServerClient(spec.grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    extras = json.loads(params["executor_extras"]["string_value"])
    assert (extras["speculative_decoding_type"], extras["max_draft_len"]) == ("DraftTarget", K)


@pytest.mark.parametrize("front", ["ensemble", "tensorrt_llm_bls"])
def test_greedy_text_identical_with_and_without_speculation(servers, front):
    plain, spec = servers
    opts = GenerateOptions(max_tokens=40)
    with Client(plain.grpc_url, model=front) as a, Client(spec.grpc_url, model=front) as b:
        for prompt in PROMPTS:
            without = a.generate(prompt, opts)
            assert len(without) > 40, without  # a story, not an early end
            assert b.generate(prompt, opts) == without, prompt


def _perf(server, ids: list[int], n: int) -> dict:
    """One request of ``n`` new tokens straight to tensorrt_llm (no end id) with return_perf_metrics."""
    import tritonclient.grpc as grpcclient

    from trtpipe.triton.client import infer_inputs

    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
    ]
    names = ("output_ids", "sequence_length", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        result = raw.infer(
            "tensorrt_llm", infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
        )
    return {x: result.as_numpy(x) for x in names}


def test_acceptance_outputs_equal_the_hand_trace(servers):
    n = 20
    assert _self_draft_trace(n, K) == (14, 5)  # by hand: out 1 -> 5 -> 9 -> 13 -> 17 (3 drafts each) -> 20 (2)
    plain, spec = servers
    for ids in ([1, 403, 407, 261, 378], [1, 365, 417, 276, 304, 263]):
        got, base = _perf(spec, ids, n), _perf(plain, ids, n)
        length = int(got["sequence_length"].reshape(-1)[0])
        assert length == n
        assert got["output_ids"].reshape(-1)[:length].tolist() == base["output_ids"].reshape(-1)[:n].tolist()
        assert int(got["total_draft_tokens"].reshape(-1)[0]) == 14
        assert int(got["total_accepted_draft_tokens"].reshape(-1)[0]) == 14
        assert float(got["acceptance_rate"].reshape(-1)[0]) == 1.0
        # without speculation the same outputs say so: nothing drafted
        assert int(base["total_draft_tokens"].reshape(-1)[0]) == 0
        assert float(base["acceptance_rate"].reshape(-1)[0]) == 0.0
