"""Lookahead decoding served by a real tritonserver through the CPU twin (engine target).

The recipe's ``speculative: {decoding_type: lookahead_decoding, max_window_size: 4, max_ngram_size: 3,
max_verification_set_size: 4}`` builds with ``--max_draft_len 15`` and writes the ``tensorrt_llm`` model's
``decoding_mode: lookahead`` and ``lookahead_*`` parameters (upstream's ``get_executor_lookahead_config``,
``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py@0d5352f5``); the twin reads them back as
its executor's configuration. Shown: the parameters as written, greedy text through the ensemble identical with and
without lookahead, a request's own ``lookahead_*`` inputs served (identical tokens, drafts verified), and the
refusals upstream makes (sizes above the model's, lookahead inputs on a model without lookahead) plus sampling.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import Client, GenerateOptions, infer_inputs  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]

W, N, G = 4, 3, 4
D = (N - 2) + (W - 1 + G) * (N - 1)  # 15
PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball."]
IDS = [1, 403, 407, 261, 378]
OUT = 24


@pytest.fixture(scope="module")
def servers(stories_dir, stories_recipe, tmp_path_factory):
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.build_config import resolve_build, to_json
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    root = tmp_path_factory.mktemp("lookahead_triton")
    ckpt = convert(stories_dir, root / "ckpt", tp=1, dtype="float32")
    base = ("model.dtype=float32", "target=engine")
    spec = (
        "speculative.decoding_type=lookahead_decoding",
        f"speculative.max_window_size={W}",
        f"speculative.max_ngram_size={N}",
        f"speculative.max_verification_set_size={G}",
    )
    recipe = stories_recipe(*base, *spec)  # validated: the recipe rules accept it
    build = to_json(resolve_build(recipe, json.loads((ckpt / "config.json").read_text())).config)
    assert (build["max_draft_len"], build["speculative_decoding_mode"]) == (D, 8)
    plain_engine = write_twin_engine(ckpt, root / "engine", dict(BUILD_CONFIG))
    la_engine = write_twin_engine(ckpt, root / "engine-lookahead", build)
    write_repo(stories_recipe(*base), plain_engine, plain_engine / "checkpoint", root / "plain")
    write_repo(recipe, la_engine, la_engine / "checkpoint", root / "spec")
    with start_server(root / "plain", timeout=240) as plain, start_server(root / "spec", timeout=240) as s:
        yield plain, s


def _infer(server, extra=(), n=OUT):
    import tritonclient.grpc as grpcclient

    rows = [
        ("input_ids", np.array([IDS], np.int32), "INT32"),
        ("input_lengths", np.array([[len(IDS)]], np.int32), "INT32"),
        ("request_output_len", np.array([[n]], np.int32), "INT32"),
        ("exclude_input_in_output", np.array([[True]]), "BOOL"),
        ("return_perf_metrics", np.array([[True]]), "BOOL"),
        *extra,
    ]
    names = ("output_ids", "total_accepted_draft_tokens", "total_draft_tokens")
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        r = raw.infer(
            "tensorrt_llm", infer_inputs(grpcclient, rows), outputs=[grpcclient.InferRequestedOutput(x) for x in names]
        )
    return {x: r.as_numpy(x).reshape(-1) for x in names}


def _sizes(w, n, g):
    return [
        (name, np.array([[v]], np.int32), "INT32")
        for name, v in (
            ("lookahead_window_size", w),
            ("lookahead_ngram_size", n),
            ("lookahead_verification_set_size", g),
        )
    ]


def test_the_repository_writes_upstreams_lookahead_parameters(servers):
    import tritonclient.grpc as grpcclient

    _, spec = servers
    with grpcclient.InferenceServerClient(spec.grpc_url) as raw:
        params = raw.get_model_config("tensorrt_llm", as_json=True)["config"]["parameters"]
    assert params["decoding_mode"]["string_value"] == "lookahead"
    got = [
        params[k]["string_value"]
        for k in ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")
    ]
    assert got == [str(W), str(N), str(G)]
    assert "speculative_decoding_type" not in json.loads(params["executor_extras"]["string_value"])


def test_greedy_text_identical_with_and_without_lookahead(servers):
    plain, spec = servers
    opts = GenerateOptions(max_tokens=40)
    with Client(plain.grpc_url, model="ensemble") as a, Client(spec.grpc_url, model="ensemble") as b:
        for prompt in PROMPTS:
            without = a.generate(prompt, opts)
            assert len(without) > 40, without
            assert b.generate(prompt, opts) == without, prompt


@pytest.mark.parametrize("sizes", [None, (W, N, G), (2, 2, 1), (3, 3, 0)])
def test_a_requests_lookahead_inputs_are_served(servers, sizes):
    plain, spec = servers
    base = _infer(plain)
    got = _infer(spec, _sizes(*sizes) if sizes else ())
    assert got["output_ids"][:OUT].tolist() == base["output_ids"][:OUT].tolist()
    drafts, accepted = int(got["total_draft_tokens"][0]), int(got["total_accepted_draft_tokens"][0])
    assert drafts > 0 and 0 <= accepted <= drafts
    print(f"lookahead {sizes or (W, N, G)} through tritonserver: {accepted} of {drafts} drafts accepted")


def test_upstreams_refusals_and_sampling(servers):
    from tritonclient.utils import InferenceServerException

    plain, spec = servers
    with pytest.raises(InferenceServerException, match=r"request lookahead \(w 5, n 3, g 4\) exceeds the model's"):
        _infer(spec, _sizes(5, 3, 4))
    with pytest.raises(InferenceServerException, match="give all three or none"):
        _infer(spec, _sizes(2, 2, 1)[:2])
    with pytest.raises(InferenceServerException, match="can only be set if the model instance lookahead parameters"):
        _infer(plain, _sizes(2, 2, 1))
    sampled = [
        ("temperature", np.array([[0.8]], np.float32), "FP32"),
        ("runtime_top_k", np.array([[5]], np.int32), "INT32"),
    ]
    with pytest.raises(InferenceServerException, match="lookahead decoding is greedy"):
        _infer(spec, sampled)
    assert _infer(plain, sampled)["output_ids"].size > 0  # the same request without lookahead samples


def test_sampling_through_http_generate_is_a_4xx(servers):
    import requests

    plain, spec = servers
    body = {"text_input": PROMPTS[0], "max_tokens": 8, "temperature": 0.8, "top_k": 5, "seed": 1}
    r = requests.post(f"{spec.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 400 and "lookahead decoding is greedy" in r.text, (r.status_code, r.text)
    ok = requests.post(f"{plain.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert ok.status_code == 200, ok.text
