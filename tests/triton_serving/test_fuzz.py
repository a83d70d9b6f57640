"""A fixed sample of the fuzz cases (tests/tools/triton_fuzz.py) against a real server (ensemble, BLS, pre/post-processing,
tensorrt_llm; HTTP and gRPC): every request gets an answer or an error, none fails inside a batch, the server
stays up and still answers a valid request correctly. The whole campaign: python tests/tools/fuzz_serving.py REPO."""

from __future__ import annotations

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from tools import triton_fuzz as fuzz
from trtpipe.triton.repo import write_repo
from trtpipe.triton.server_process import start_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def test_fuzzed_requests_get_an_answer_or_an_error(stories_engine, stories_recipe, tmp_path):
    engine = stories_engine(1)
    repo = tmp_path / "repo"
    write_repo(stories_recipe("triton.bls=true"), engine, engine / "checkpoint", repo)
    with start_server(repo, timeout=300) as server:
        summary = fuzz.run(server.http_url, server.grpc_url, limit=100, seed=1, check_every=40, alive=server.alive)
    print(summary)
    assert summary["failures"] == []
    assert summary["models"] == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    assert (
        summary["requests"] == 200
        and sum(v for k, v in summary["outcomes"].items() if " " in k and k.split(" ")[0] in ("http", "grpc")) == 200
    )
