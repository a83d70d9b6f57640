"""stories260k fp16, tp=2 (the twin runs both ranks' shards), on a real tritonserver, non-streaming repository
served over HTTP, with a generation_config listing two EOS ids (as Llama-3 does): generation stops on either
by default. Also the BLS model (recipe triton.bls) and the prompt-included output.
"""

from __future__ import annotations


import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.repo import read_configs, write_repo
from trtpipe.triton.server_process import start_server
from triton_helpers import run_concurrently

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.fixture(scope="module")
def period(hf_stories):
    return hf_stories[0].encode("Lily.", add_special_tokens=False)[-1]  # the "." token


@pytest.fixture(scope="module")
def repo(stories_engine, stories_recipe, tmp_path_factory, period, tokenizer_with_eos):
    engine = stories_engine(2)
    root = tmp_path_factory.mktemp("tp2")
    tokenizer = tokenizer_with_eos(root / "tokenizer", [2, period])
    write_repo(stories_recipe("triton.bls=true", "parallel.tp=2"), engine, tokenizer, root / "repo")
    return root / "repo"


@pytest.fixture(scope="module")
def server(repo):
    with start_server(repo, timeout=240) as s:
        yield s


def test_repo_has_the_extra_eos_as_a_default_stop_id(repo, period):
    pre = read_configs(repo)["preprocessing"]
    assert pre.parameters["end_id"].string_value == "2"
    assert pre.parameters["stop_token_ids"].string_value == str(period)
    assert not read_configs(repo)["tensorrt_llm"].model_transaction_policy.decoupled


def test_greedy_tp2_equals_transformers_and_stops_at_either_eos(server, hf_greedy, period):
    new, expected = hf_greedy("Once upon a time", 60, eos=(2, period))
    assert new[-1] == period and len(new) < 60  # transformers stops at the "." too
    with Client(server.http_url, protocol="http") as c:
        got = c.generate("Once upon a time", GenerateOptions(max_tokens=60))
    assert got == expected == ", there was a little girl named Lily."


def test_sixteen_concurrent_http_requests(server, hf_greedy, period):
    prompts = ["Once upon a time", "Lily wanted to", "Tom had a big red ball.", "One day, a cat saw a bird"]

    def ask(i):
        with Client(server.http_url, protocol="http") as c:
            return c.generate(prompts[i % 4], GenerateOptions(max_tokens=32))

    results = run_concurrently(ask, 16, timeout=120)
    assert {i: results[i] for i in range(16)} == {
        i: hf_greedy(prompts[i % 4], 32, eos=(2, period))[1] for i in range(16)
    }


def test_bls_and_prompt_included_output(server, hf_stories, hf_greedy, period):
    tok, _ = hf_stories
    new, expected = hf_greedy("Lily wanted to", 40, eos=(2, period))
    with Client(server.grpc_url, model="tensorrt_llm_bls") as c:
        assert c.generate("Lily wanted to", GenerateOptions(max_tokens=40)) == expected
    with Client(server.grpc_url) as c:
        full = c.generate("Lily wanted to", GenerateOptions(max_tokens=40, exclude_input_in_output=False))
    assert full == tok.decode(tok.encode("Lily wanted to") + new, skip_special_tokens=True)
    assert full == "Lily wanted to go on a walk."


def test_tensorrt_llm_model_called_directly_with_token_ids(server, hf_greedy):
    """The twin's own contract (§6.3 tensors): input_ids/input_lengths/request_output_len → output_ids/sequence_length."""
    import numpy as np
    import tritonclient.http as httpclient

    new, _ = hf_greedy("Once upon a time", 8)
    prompt = np.array([[1, 403, 407, 261, 378]], dtype=np.int32)  # "Once upon a time" (SOURCE.md)
    rows = [
        ("input_ids", prompt),
        ("input_lengths", np.array([[5]], np.int32)),
        ("request_output_len", np.array([[8]], np.int32)),
    ]
    inputs = []
    for name, array in rows:
        i = httpclient.InferInput(name, list(array.shape), "INT32")
        i.set_data_from_numpy(array)
        inputs.append(i)
    c = httpclient.InferenceServerClient(server.http_url.split("://")[1])
    try:
        result = c.infer("tensorrt_llm", inputs)
    finally:
        c.close()
    assert result.as_numpy("output_ids").tolist() == [[new]]  # [batch, beam, tokens], new tokens only
    assert result.as_numpy("sequence_length").tolist() == [[8]]
