"""The OpenAI twin under pressure, over real HTTP: a full queue answers 429 with Retry-After and sheds the lowest
priority first (the ``priority`` field reaches the executor), a request past the recipe's deadline answers 504 (an
error event when streaming), and an executor that stopped turns /health and every request into 503 at once.
No timing is asserted: each step waits for the executor's own state (queue length, first token)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time

import pytest
from openai_helpers import serve_in_thread

from trtpipe.serving.reference_engine import ReferenceEngine
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

PROMPT = "Once upon a time"


def _served(export, **config):
    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    served = ServedModel(export, "pressure", dataclasses.replace(twin_default(512), **config))
    return served, OpenAIServer(served).app


def _post(url: str, body: dict, path: str = "/v1/completions"):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _wait(condition, what: str, limit_s: float = 120.0) -> None:
    """Poll the executor's state (not a timed assertion: the limit only turns a hang into a failure)."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def _openai_error(status: int, headers: dict, body: bytes, code: int, retry: bool) -> dict:
    assert status == code, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["type"] and "param" in err
    assert ("Retry-After" in headers) == retry
    return err


class _Gated(ReferenceEngine):
    """The real engine, whose second step waits for the test: the first request holds the one batch slot
    while the test fills the queue (so nothing depends on how fast the model generates)."""

    def __init__(self, model):
        super().__init__(model)
        self.at_gate, self.gate = threading.Event(), threading.Event()

    def step(self, batch):
        if batch.iteration == 1:
            self.at_gate.set()
            self.gate.wait(300)
        return super().step(batch)


def test_a_full_queue_answers_429_and_sheds_the_lowest_priority(stories_fp16_export, fp16_greedy_text):
    from trtpipe.serving.executor import Executor

    served, app = _served(stories_fp16_export, max_batch_size=1, max_queue_size=1)
    model = served.executor.core.engine.model
    served.executor.shutdown()
    served.executor = Executor(served.config, engine := _Gated(model))
    core = served.executor.core
    try:
        with serve_in_thread(app) as url:
            results = {}

            def send(name, body):
                results[name] = _post(url, body)

            def start(name, body):
                t = threading.Thread(target=send, args=(name, body))
                t.start()
                return t

            hold = start("hold", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            assert engine.at_gate.wait(300)  # holding the slot, inside its second step
            low = start("low", {"prompt": PROMPT, "max_tokens": 4, "priority": 0.1})
            _wait(lambda: len(core.queue) == 1, "the low-priority request queued")
            err = _openai_error(*_post(url, {"prompt": PROMPT, "max_tokens": 4, "priority": 0.1}), 429, retry=True)
            assert "Maximum queue size of 1 has been reached" in err["message"] and err["type"] == "RateLimitError"
            high = start("high", {"prompt": PROMPT, "max_tokens": 4, "priority": 0.9, "temperature": 0})
            _wait(lambda: core.queue and core.queue[0].priority == 0.9, "the high-priority request queued")
            engine.gate.set()  # full of a lower priority: the low one was shed, the high one takes the slot next
            for t in (low, high, hold):
                t.join(300)
        err = _openai_error(*results["low"], 429, retry=True)
        assert "shed for a request of higher priority" in err["message"]
        assert results["hold"][0] == 200 and results["high"][0] == 200
        assert json.loads(results["high"][2])["choices"][0]["text"] == fp16_greedy_text(PROMPT, 4)
        assert json.loads(results["hold"][2])["choices"][0]["text"] == fp16_greedy_text(PROMPT, 8)
    finally:
        served.shutdown()


def test_a_request_past_its_deadline_answers_504(stories_fp16_export):
    served, app = _served(stories_fp16_export, request_timeout_s=1e-6)  # every request is late at the next turn
    try:
        with serve_in_thread(app) as url:
            err = _openai_error(*_post(url, {"prompt": PROMPT, "max_tokens": 8}), 504, retry=False)
            assert err["message"].startswith("Request timed out") and err["type"] == "TimeoutError"
            status, _, body = _post(url, {"prompt": PROMPT, "max_tokens": 8, "stream": True})
            events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
            assert status == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == 504
    finally:
        served.shutdown()


def test_a_stopped_executor_turns_health_and_requests_into_503(stories_fp16_export):
    import urllib.error
    import urllib.request

    served, app = _served(stories_fp16_export)
    try:
        with serve_in_thread(app) as url:
            with urllib.request.urlopen(url + "/health") as r:
                assert r.status == 200
            served.executor.shutdown()  # the loop ends (as it would if it died): no request could be answered now
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(url + "/health")
            assert info.value.code == 503 and info.value.headers["Retry-After"]
            err = _openai_error(*_post(url, {"prompt": PROMPT, "max_tokens": 4}), 503, retry=True)
            assert "LLM is unavailable" in err["message"]
    finally:
        served.shutdown()


def test_a_non_streaming_client_that_leaves_is_cancelled(stories_fp16_export):
    """A non-streaming request whose client closes the connection is cancelled in the executor (it would otherwise
    generate all of its 400 tokens, or until its deadline): the request is held inside its second step while the
    client leaves, then ends with the token or two it had."""
    import socket

    from trtpipe.serving.executor import Executor

    class Recording(Executor):
        """The real executor, noting which requests a front end cancels."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.cancelled = []

        def cancel(self, request_id):
            self.cancelled.append(request_id)
            super().cancel(request_id)

    served, app = _served(stories_fp16_export, max_batch_size=1)
    model = served.executor.core.engine.model
    served.executor.shutdown()
    served.executor = ex = Recording(served.config, engine := _Gated(model))
    try:
        with serve_in_thread(app) as url:
            host, port = url.split("//")[1].split(":")
            body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 3}).encode()
            with socket.create_connection((host, int(port)), timeout=60) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                assert engine.at_gate.wait(300)  # generating, inside its second step
            _wait(lambda: ex.cancelled, "the request cancelled after its client left")
            engine.gate.set()
            _wait(lambda: not ex.core.busy, "the cancelled request gone from the executor")
            ((_, n_out),) = ex.core.finished_lengths
            assert n_out < 400, n_out
            status, _, reply = _post(url, {"prompt": PROMPT, "max_tokens": 4})  # still serving
            assert status == 200, reply[:200]
    finally:
        served.shutdown()
