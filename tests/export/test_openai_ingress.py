"""What one client sends must not hurt the server or the others (issue 38, item 9): a prompt holding a lone
surrogate is a 400 (it was a 500), and a body that never completes is answered 408 after the server's body timeout
(it held its connection forever), and a streaming client that leaves while its request is still queued frees its queue
slot (it kept it until the request was admitted)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]


@pytest.fixture(scope="module")
def server(stories_fp16_export):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    served = ServedModel(stories_fp16_export, "ingress")
    with serve_in_thread(OpenAIServer(served).app) as base:
        yield base, served  # the app shuts the model down with it


@pytest.mark.parametrize("prompt", ['"\\ud800"', '"a \\udfff b"', '["\\uDBFF"]'])
def test_a_lone_surrogate_is_a_400(server, prompt):
    url = server[0]
    body = '{"prompt": ' + prompt + ', "max_tokens": 2}'
    r = requests.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    ok = requests.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_paired_surrogate_escape_is_text(server):
    url = server[0]
    body = '{"prompt": "Once \\ud83d\\ude00", "max_tokens": 2}'  # one emoji, escaped as a valid pair
    r = requests.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_body_that_never_completes_gets_408(server, monkeypatch):
    url = server[0]
    from trtpipe.serving import openai_server

    monkeypatch.setattr(openai_server, "BODY_TIMEOUT_S", 0.5, raising=False)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "Once'
        )
        head = s.recv(4096)  # the old server never answered: this read timed out after 60 s
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"request body" in head


def _wait_for(what, ok, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_streaming_client_that_leaves_while_queued_frees_its_slot(server, monkeypatch):
    url, served = server
    core = served.executor.core
    monkeypatch.setattr(core, "_admit", lambda: None)  # nothing is admitted: the request stays queued
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 4, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _wait_for("the streaming request was never queued", lambda: len(core.queue) == 1)
    _wait_for("the request of a client that left stays queued", lambda: not core.queue)
    monkeypatch.undo()
    ok = requests.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_a_prompt_past_the_context_is_refused_untokenized_and_tokenizing_has_its_own_pool(server, monkeypatch):
    url, served = server
    tok, calls = served.tokenizer, []
    encode = tok.encode

    def recording(text, *a, **kw):
        calls.append((len(text), threading.current_thread().name))
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", recording)
    k = getattr(served, "max_chars_per_token", 1)
    huge = "Once upon a time " * (served.max_seq_len * max(k, 16) // 17 + 1)
    r = requests.post(url + "/v1/completions", json={"prompt": huge, "max_tokens": 2}, timeout=120)
    assert r.status_code == 400, r.text
    assert "characters" in r.json()["error"]["message"]
    assert calls == []  # refused before tokenizing
    chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    served.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        r = requests.post(url + "/v1/chat/completions", json=chat, timeout=120)
    finally:
        served.tokenizer.chat_template = None
    assert r.status_code == 400 and calls == [], r.text
    ok = requests.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert [name.startswith("trtpipe-tokenize") for _, name in calls] == [True]  # not the loop's shared pool
