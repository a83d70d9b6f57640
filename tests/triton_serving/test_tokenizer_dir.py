"""trtpipe's python models and the absolute ``tokenizer_dir`` the repository writes (trtpipe/triton/repo.py,
point_tokenizer_dirs): served as written, and still served once the tokenizer files it points at are gone (a
repository moved away from its build), from the ``tokenizer/`` copy beside each model. Upstream's models reading
the same path: tests/triton_serving/test_repo.py."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.repo import TOKENIZER_FILES, read_configs, write_repo
from trtpipe.triton.server_process import start_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]


def test_a_repository_whose_tokenizer_source_is_gone_still_serves(stories_engine, stories_recipe, tmp_path, hf_greedy):
    engine = stories_engine(1)
    source = tmp_path / "source"  # the tokenizer files the repository is built from, removed before serving
    source.mkdir()
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (engine / "checkpoint" / name).exists():
            shutil.copy2(engine / "checkpoint" / name, source / name)
    repo = tmp_path / "repo"
    write_repo(stories_recipe("triton.bls=true"), engine, source, repo)
    assert {
        c.parameters["tokenizer_dir"].string_value
        for m, c in read_configs(repo).items()
        if "tokenizer_dir" in c.parameters
    } == {str(source.resolve())}
    shutil.rmtree(source)
    with start_server(repo, timeout=240) as server:
        with Client(server.grpc_url) as c:
            text = c.generate("Once upon a time", GenerateOptions(max_tokens=16))
        with Client(server.grpc_url, model="tensorrt_llm_bls") as c:
            bls = c.generate("Once upon a time", GenerateOptions(max_tokens=16))
    assert text == bls == hf_greedy("Once upon a time", 16)[1]
