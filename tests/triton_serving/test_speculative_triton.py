"""Draft-target speculative decoding of an engine-target recipe served by a real tritonserver through the CPU twin,
in upstream's two-model form.

The recipe's ``speculative: {decoding_type: draft_tokens_external, speculative_model: <draft>, max_draft_len: N}``
(trtllm-build's ``--speculative_decoding_mode draft_tokens_external --max_draft_len N``,
``tensorrt_llm/commands/build.py@65f1d153``) is served as tensorrtllm_backend documents it
(``examples/draft_target_model/README.md@567239fc``, "Triton Inference Server workflow"): a second ``tensorrt_llm``
model, ``tensorrt_llm_draft``, on the draft engine, and the BLS's ``tensorrt_llm_draft_model_name`` naming it. A
request asks for speculation with ``num_draft_tokens``; the BLS runs the rounds of upstream's
``tensorrt_llm_bls/1/lib/decode.py@4db68284`` (draft k tokens, the target verifies them as ``draft_input_ids`` in one
forward, the accepted tokens and the target's own are appended).

Shown here, target = draft = stories260k in float32 (the same weights, so every draft is the target's argmax):
- greedy text through the BLS with ``num_draft_tokens`` is the text without speculation, over a prompt set;
- the acceptance outputs (``return_perf_metrics``) equal the rounds worked out by hand: every draft accepted;
- ``tensorrt_llm`` itself verifies ``draft_input_ids``: a wrong draft keeps the drafts before it;
- what a speculative request cannot have is refused in one line.
The INT4 draft's measured rate: tests/triton_serving/test_speculative_int4_triton.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import infer_inputs  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402


pytestmark = [pytest.mark.triton, pytest.mark.slow]

K = 3  # max_draft_len, and the requests' num_draft_tokens
PROMPTS = [
    "Once upon a time",
    "Lily wanted to",
    "Tom had a big red ball.",
    "One day, a cat saw a bird",
    "The sun was shining and the birds were singing. The sun was",
]


def rounds(n: int, k: int) -> tuple[int, int]:
    """(drafts, rounds) of a BLS request of n new tokens, no end, when every draft is accepted: each round drafts
    min(k, n - out - 1) (decode.py's ``num_draft_tokens``) and the target returns that many + 1."""
    out, drafts, steps = 0, 0, 0
    while out < n:
        d = min(k, n - out - 1)
        drafts, steps, out = drafts + d, steps + 1, out + d + 1
    return drafts, steps


RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def build_repo(tmp: Path, model: Path, *overrides: str) -> Path:
    """``trtpipe build`` of stories-fp16 in float32 with ``overrides``: the repository it writes."""
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe
    from trtpipe.pipeline.runner import run_build

    text = (RECIPES / "stories-fp16.yaml").read_text().replace("../models/stories260k", str(model))
    path = tmp / "recipe.yaml"
    path.write_text(text.replace("work_dir: work/", f"work_dir: {tmp}/work/"))
    sets = ("model.dtype=float32", "triton.bls=true", *overrides)
    return run_build(load_recipe(path, sets), STAGES, quiet=True).artifact("repo")


def speculative(draft: Path) -> tuple[str, ...]:
    return (
        "speculative.decoding_type=draft_tokens_external",
        f"speculative.speculative_model={draft}",
        f"speculative.max_draft_len={K}",
    )


@pytest.fixture(scope="module")
def servers(stories_dir, tmp_path_factory):
    """(plain, speculative): the plain repository and the two-model one (the model as its own draft), both built by
    the pipeline (checkpoint, engine, draft_engine, repo)."""
    plain = build_repo(tmp_path_factory.mktemp("plain"), stories_dir)
    spec = build_repo(tmp_path_factory.mktemp("spec"), stories_dir, *speculative(stories_dir))
    with start_server(plain, timeout=240) as p, start_server(spec, timeout=240) as s:
        yield p, s


def bls(server, prompt: str, n: int, **extra) -> dict:
    """One tensorrt_llm_bls request (not streamed); its outputs as numpy, or the error's message under "error"."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    rows = [
        ("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        ("max_tokens", np.array([[n]], np.int32), "INT32"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
        ("return_num_output_tokens", np.array([[True]]), "BOOL"),
    ]
    for name, v in extra.items():
        if isinstance(v, bool):
            rows.append((name, np.array([[v]]), "BOOL"))
        elif isinstance(v, float):
            rows.append((name, np.array([[v]], np.float32), "FP32"))
        elif name == "seed":
            rows.append((name, np.array([[v]], np.uint64), "UINT64"))
        else:
            rows.append((name, np.array([[v]], np.int32), "INT32"))
    names = ["text_output", "num_output_tokens"]
    if "num_draft_tokens" in extra:
        names += ["acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"]
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        try:
            result = raw.infer(
                "tensorrt_llm_bls",
                infer_inputs(grpcclient, rows),
                outputs=[grpcclient.InferRequestedOutput(x) for x in names],
            )
        except InferenceServerException as exc:
            return {"error": exc.message()}
    out = {x: result.as_numpy(x) for x in names}
    out["text_output"] = out["text_output"].reshape(-1)[0].decode()
    return out


def test_the_repository_is_upstreams_two_model_form(servers):
    import json

    import tritonclient.grpc as grpcclient

    _, spec = servers
    with grpcclient.InferenceServerClient(spec.grpc_url) as raw:
        assert raw.is_model_ready("tensorrt_llm_draft") and raw.is_model_ready("tensorrt_llm")
        params = raw.get_model_config("tensorrt_llm_bls", as_json=True)["config"]["parameters"]
        assert params["tensorrt_llm_draft_model_name"]["string_value"] == "tensorrt_llm_draft"
        for model in ("tensorrt_llm", "tensorrt_llm_draft"):  # neither drafts by itself: the BLS brings the drafts
            p = raw.get_model_config(model, as_json=True)["config"]["parameters"]
            assert "speculative_decoding_type" not in json.loads(p["executor_extras"]["string_value"])
        draft = raw.get_model_config("tensorrt_llm_draft", as_json=True)["config"]["parameters"]
        assert draft["enable_kv_cache_reuse"]["string_value"] == "true"  # as upstream's README sets it


def test_greedy_text_identical_with_and_without_the_draft_model(servers):
    plain, spec = servers
    for prompt in PROMPTS:
        without = bls(plain, prompt, 40)
        assert int(without["num_output_tokens"].reshape(-1)[0]) > 20, without  # a story, not an early end
        got = bls(spec, prompt, 40, num_draft_tokens=K)
        assert got["text_output"] == without["text_output"], prompt
        assert float(got["acceptance_rate"].reshape(-1)[0]) == 1.0  # the model as its own draft
        assert bls(spec, prompt, 40)["text_output"] == without["text_output"]  # no num_draft_tokens: no draft


def test_acceptance_outputs_equal_the_hand_trace(servers):
    n = 20
    assert rounds(n, K) == (15, 5)  # by hand: out 0 -> 4 -> 8 -> 12 -> 16 -> 20, 3 drafts each round
    plain, spec = servers
    for prompt in PROMPTS[:2]:
        assert int(bls(plain, prompt, n)["num_output_tokens"].reshape(-1)[0]) == n  # no end id before n tokens
        got = bls(spec, prompt, n, num_draft_tokens=K)
        assert int(got["num_output_tokens"].reshape(-1)[0]) == n
        assert int(got["total_draft_tokens"].reshape(-1)[0]) == 15
        assert int(got["total_accepted_draft_tokens"].reshape(-1)[0]) == 15


def _llm(server, ids: list[int], n: int, drafts: list[int]) -> dict:
    """One request straight to tensorrt_llm with ``draft_input_ids`` (no end id) and return_perf_metrics."""
    import tritonclient.grpc as grpcclient

    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("end_id", np.array([[-1]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
    ]
    if drafts:
        rows.append(("draft_input_ids", np.array([drafts], np.int32), "INT32"))
    names = ("output_ids", "sequence_length", "total_accepted_draft_tokens", "total_draft_tokens")
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        result = raw.infer(
            "tensorrt_llm", infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
        )
    out = {x: result.as_numpy(x).reshape(-1) for x in names}
    return {
        "ids": out["output_ids"][: int(out["sequence_length"][0])].tolist(),
        **{x: int(out[x][0]) for x in names[2:]},
    }


def test_the_target_verifies_draft_input_ids(servers):
    _, spec = servers
    ids = [1, 403, 407, 261, 378]
    greedy = _llm(spec, ids, 6, [])["ids"]
    assert len(greedy) == 6
    right = _llm(spec, ids, K + 1, greedy[:K])
    assert (right["ids"], right["total_draft_tokens"], right["total_accepted_draft_tokens"]) == (greedy[: K + 1], K, K)
    wrong = list(greedy[:K])
    wrong[1] = (wrong[1] + 1) % 512
    got = _llm(spec, ids, K + 1, wrong)  # keeps d1, then the target's own token; then decodes to K + 1 tokens
    assert (got["ids"], got["total_draft_tokens"], got["total_accepted_draft_tokens"]) == (greedy[: K + 1], K, 1)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"stream": True}, "streaming is not supported with speculative decoding"),
        ({"min_tokens": 4}, "min_tokens is not supported with speculative decoding"),
    ],
)
def test_what_a_speculative_request_cannot_have_is_refused(servers, extra, message):
    _, spec = servers
    got = bls(spec, PROMPTS[0], 8, num_draft_tokens=K, **extra)
    assert message in got.get("error", ""), got


def test_draft_logits_keep_greedy_text_and_the_self_drafts_acceptance(servers):
    """``use_draft_logits``: the draft's generation_logits travel to the target as draft_logits (decode.py@4db68284);
    greedy verification still matches tokens, so the text is the plain one and the model as its own draft keeps every
    draft; sampled, a draft whose q equals the target's p is kept with probability min(1, p/q) = 1."""
    plain, spec = servers
    for prompt in PROMPTS[:3]:
        want = bls(plain, prompt, 24)["text_output"]
        got = bls(spec, prompt, 24, num_draft_tokens=K, use_draft_logits=True)
        assert got.get("text_output") == want, got
        assert float(got["acceptance_rate"].reshape(-1)[0]) == 1.0
    sampled = bls(spec, PROMPTS[0], 20, num_draft_tokens=K, use_draft_logits=True, temperature=1.0, seed=7)
    assert (
        int(sampled["total_draft_tokens"].reshape(-1)[0])
        == int(sampled["total_accepted_draft_tokens"].reshape(-1)[0])
        > 0
    ), sampled


def test_speculation_without_a_draft_model_is_refused(servers):
    plain, _ = servers
    assert "cannot perform speculative decoding without draft model" in bls(
        plain, PROMPTS[0], 8, num_draft_tokens=K
    ).get("error", "")
