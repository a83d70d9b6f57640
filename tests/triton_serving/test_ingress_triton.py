"""The Triton front on what the OpenAI twin now refuses (issue 38, item 9): a lone surrogate in a generate request
and a body that never completes. Both are tritonserver's own (its JSON parser, its HTTP server): the server keeps
answering others; a lone surrogate is its 500 "failed to parse the request JSON buffer: The surrogate pair in string
is invalid" (the generate extension answers every JSON parse error so), which trtpipe cannot change: marked xfail
(strict) until tritonserver answers 4xx."""

from __future__ import annotations

import socket

import pytest
import requests

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")

from trtpipe.triton.repo import write_repo
from trtpipe.triton.server_process import start_server

pytestmark = [pytest.mark.triton, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(stories_engine, stories_recipe, tmp_path_factory):
    engine = stories_engine(1)
    repo = tmp_path_factory.mktemp("ingress") / "repo"
    write_repo(stories_recipe(), engine, engine / "checkpoint", repo)
    with start_server(repo, timeout=240) as s:
        yield s


def _generate(server, body: str) -> requests.Response:
    url = f"{server.http_url}/v2/models/ensemble/generate"
    return requests.post(url, data=body.encode(), headers={"Content-Type": "application/json"}, timeout=120)


LONE = '{"text_input": "Once \\ud800 upon", "max_tokens": 2}'


def test_a_lone_surrogate_is_named_and_the_server_keeps_answering(server):
    r = _generate(server, LONE)
    assert r.status_code != 200 and "surrogate" in r.text, (r.status_code, r.text)
    ok = _generate(server, '{"text_input": "Once upon a time", "max_tokens": 2}')
    assert ok.status_code == 200, ok.text


@pytest.mark.xfail(strict=True, reason="tritonserver 2.51's generate extension answers a JSON parse error with 500")
def test_a_lone_surrogate_is_a_4xx(server):
    r = _generate(server, LONE)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)


def test_a_body_that_never_completes_does_not_stop_others(server):
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        ok = _generate(server, '{"text_input": "Once upon a time", "max_tokens": 2}')
        assert ok.status_code == 200, ok.text
