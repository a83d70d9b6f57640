"""``return_log_probs`` and ``min_tokens`` through the BLS on a real tritonserver, as upstream's BLS carries them
(NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/triton_decoder.py@07f3e442):
``output_log_probs`` / ``cum_log_probs`` from the BLS equal the ensemble's and tensorrt_llm's, streamed and not, and
transformers' float64 log-softmax of the sampled tokens within ``ORDER_FACTOR`` x the float32 error scale
(tests/numerics.py); ``min_tokens`` holds the end id off in the BLS as in the ensemble.

The engine is stories260k converted at float32, so that the twin's float32 logits meet the float32 error scale."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from numerics import ORDER_FACTOR, U32, error_scale  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]
PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]  # PROMPT in the stories tokenizer
SAMPLED = {"temperature": np.array([[0.9]], np.float32), "seed": np.array([[4]], np.uint64)}


@pytest.fixture(scope="module", params=["decoupled", "not decoupled"])
def server(request, stories_dir, stories_recipe, tmp_path_factory):
    """A server whose models are decoupled (triton.streaming) or not; ``.streams``: the ``stream`` values to try."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine

    root = tmp_path_factory.mktemp("bls_logprobs")
    engine = write_twin_engine(
        convert(stories_dir, root / "ckpt", tp=1, dtype="float32"), root / "engine", BUILD_CONFIG
    )
    decoupled = request.param == "decoupled"
    recipe = stories_recipe("triton.bls=true", f"triton.streaming={str(decoupled).lower()}")
    write_repo(recipe, engine, engine / "checkpoint", root / "repo")
    with start_server(root / "repo", timeout=240) as s:
        s.streams = (False, True) if decoupled else (False,)
        yield s


def _ask(server, model: str, inputs: dict, outputs: list[str]) -> list[dict]:
    """One request on the gRPC stream (every model here is decoupled): the responses' ``outputs`` present."""
    import tritonclient.grpc as grpcclient

    def tensor(name, array):
        t = grpcclient.InferInput(name, list(array.shape), grpcclient.np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        return t

    raw = grpcclient.InferenceServerClient(server.grpc_url)
    done, errors, got = threading.Event(), [], []

    def on(result, error):
        if error is not None:
            errors.append(error)
            done.set()
            return
        got.append({n: result.as_numpy(n) for n in outputs if result.as_numpy(n) is not None})
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    raw.start_stream(callback=on)
    try:
        raw.async_stream_infer(model, [tensor(n, a) for n, a in inputs.items()], enable_empty_final_response=True)
        assert done.wait(60)
    finally:
        raw.stop_stream()
        raw.close()
    assert not errors, errors
    return got


def _front(server, model: str, stream: bool, **extra) -> tuple[str, list[float], list[float]]:
    """(text, output log probs joined over the responses, each response's cum log prob) from the ensemble or BLS."""
    inputs = {
        "text_input": np.array([[PROMPT.encode()]], dtype=object),
        "max_tokens": np.array([[10]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
        "stream": np.array([[stream]]),
        **extra,
    }
    got = _ask(server, model, inputs, ["text_output", "output_log_probs", "cum_log_probs"])
    text = "".join(r["text_output"].reshape(-1)[0].decode() for r in got if "text_output" in r)
    for r in got:
        if "output_log_probs" in r:
            assert r["output_log_probs"].shape[:2] == (1, 1) and r["cum_log_probs"].shape == (1, 1)
    lps = [float(v) for r in got if "output_log_probs" in r for v in r["output_log_probs"].reshape(-1)]
    cums = [float(r["cum_log_probs"][0, 0]) for r in got if "cum_log_probs" in r]
    return text, lps, cums


def _tensorrt_llm(server, **extra) -> tuple[list[int], list[float]]:
    """(output tokens, their log probs) straight from tensorrt_llm, unstreamed."""
    inputs = {
        "input_ids": np.array([PROMPT_IDS], np.int32),
        "input_lengths": np.array([[len(PROMPT_IDS)]], np.int32),
        "request_output_len": np.array([[10]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
        "streaming": np.array([[False]]),
        **extra,
    }
    got = _ask(server, "tensorrt_llm", inputs, ["output_ids", "output_log_probs"])
    tokens = [int(t) for r in got if "output_ids" in r for t in r["output_ids"].reshape(-1)]
    return tokens, [float(v) for r in got if "output_log_probs" in r for v in r["output_log_probs"].reshape(-1)]


def test_bls_log_probs_equal_the_ensembles_and_float64(server, stories_dir):
    import torch

    from trtpipe.models.synthetic import load_hf

    asked = {"return_log_probs": np.array([[True]]), **SAMPLED}
    tokens, direct = _tensorrt_llm(
        server, return_log_probs=asked["return_log_probs"], temperature=SAMPLED["temperature"], seed=SAMPLED["seed"]
    )
    assert len(tokens) == len(direct) == 10
    seen = {}
    for model in ("ensemble", "tensorrt_llm_bls"):
        for stream in server.streams:
            text, lps, cums = _front(server, model, stream, **asked)
            assert lps == direct, (model, stream)  # the same sampled tokens, the same float32 values
            assert cums[-1] == pytest.approx(sum(direct), abs=1e-4), (model, stream)
            seen[model, stream] = text
    # the same text, but for the streamed ensemble: its postprocessing decodes each token alone, dropping the
    # SentencePiece spaces (docs/reference/triton-repository.md#ensemble)
    if ("ensemble", True) in seen:
        assert seen.pop(("ensemble", True)) == seen["ensemble", False].replace(" ", "")
    assert len(set(seen.values())) == 1, seen
    plain, lps, cums = _front(server, "tensorrt_llm_bls", server.streams[-1], **SAMPLED)
    assert plain == seen["tensorrt_llm_bls", False] and not lps and not cums  # nothing unless asked

    seq = torch.tensor([PROMPT_IDS + tokens])
    with torch.no_grad():
        lp64 = torch.log_softmax(load_hf(stories_dir).double().eval()(seq).logits[0], -1)
        lp32 = torch.log_softmax(load_hf(stories_dir).float().eval()(seq).logits[0], -1)
    tol = ORDER_FACTOR * error_scale(lp32, lp64, U32)
    want = [float(lp64[len(PROMPT_IDS) + j - 1, t]) for j, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(direct, want)) <= tol


def test_bls_min_tokens_holds_the_end_id_as_the_ensemble_does(server):
    tokens, _ = _tensorrt_llm(server)  # greedy
    end = np.array([[tokens[1]]], np.int32)  # the end id greedy reaches at its second output token
    for stream in server.streams:
        short = {m: _front(server, m, stream, end_id=end)[0] for m in ("ensemble", "tensorrt_llm_bls")}
        held = {
            m: _front(server, m, stream, end_id=end, min_tokens=np.array([[5]], np.int32))[0]
            for m in ("ensemble", "tensorrt_llm_bls")
        }
        for texts in (short, held):  # a streamed ensemble loses the spaces (see above)
            bls = texts["tensorrt_llm_bls"]
            assert texts["ensemble"] == (bls.replace(" ", "") if stream else bls), (stream, texts)
        assert len(held["tensorrt_llm_bls"]) > len(short["tensorrt_llm_bls"]), (short, held)
