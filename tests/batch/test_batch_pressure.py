"""How the batch client backs off: Retry-After read as RFC 9110 writes it, the AIMD window halved once per burst
of refusals, the server's gauges read, and each kind of answer settled as the table in trtpipe.batch.client says
(journaled, retried, or sent again without the 'priority' field an older server refuses)."""

from __future__ import annotations

import email.utils
import json

import pytest

from trtpipe.batch.client import BatchClient, ClientOptions, Item, Outcome, mentions_priority
from trtpipe.batch.journal import Journal, default_errors_path, default_state_path
from trtpipe.batch.pressure import (
    MAX_RETRY_AFTER_S,
    ServerLoad,
    Window,
    backoff_s,
    parse_retry_after,
    server_load,
    under_pressure,
)
from trtpipe.batch.requests import BatchRequest
from optional import needs

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    "header, seconds",
    [
        ("3", 3.0),
        (" 0.5 ", 0.5),
        ("-4", 0.0),
        ("100000", MAX_RETRY_AFTER_S),
        (email.utils.formatdate(NOW + 10, usegmt=True), 10.0),
        (email.utils.formatdate(NOW - 10, usegmt=True), 0.0),
        (None, None),
        ("soon", None),
        ("nan", None),
    ],
)
def test_retry_after(header, seconds):
    assert parse_retry_after(header, NOW) == seconds


def test_backoff_doubles_and_is_capped():
    assert [backoff_s(a) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_s(30) == 30.0


def test_window_halves_once_per_epoch_and_grows_back_by_one_per_window():
    w = Window(8)
    epoch = w.epoch
    assert w.on_pressure(epoch) and w.allowed == 4
    assert not w.on_pressure(epoch) and w.allowed == 4  # the same burst: already accounted for
    assert w.on_pressure(w.epoch) and w.allowed == 2
    for _ in range(2):
        w.on_success()  # 2 + 1/2 + 1/2.5
    assert w.allowed == 2 and w.size == pytest.approx(2.9)
    for _ in range(100):
        w.on_success()
    assert w.allowed == 8  # never above --concurrency
    for _ in range(10):
        w.on_pressure(w.epoch)
    assert w.allowed == 1


TWIN_TEXT = """# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 8
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 11
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.25
"""


def test_server_load_and_pressure():
    load = server_load(TWIN_TEXT)
    assert load == ServerLoad(11.0, 0.25)
    assert under_pressure(load, ours_in_flight=8)  # 11 waiting: 3 or more are someone else's
    assert not under_pressure(load, ours_in_flight=16)
    assert under_pressure(ServerLoad(None, 0.97), 16) and not under_pressure(ServerLoad(None, None), 0)


def test_an_older_servers_refusal_of_priority_is_recognised():
    """trtllm-serve's request models forbid unknown fields (pydantic ``extra="forbid"``); before it had the
    ``priority`` field, pydantic's own message named it. The message is pydantic's, produced here."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    class OldCompletionRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: str
        prompt: str

    with pytest.raises(ValidationError) as e:
        OldCompletionRequest.model_validate({"model": "m", "prompt": "x", "priority": 0.0})
    body = json.dumps({"object": "error", "message": str(e.value), "type": "BadRequestError", "code": 400})
    assert mentions_priority(400, body) and mentions_priority(422, body)
    assert not mentions_priority(500, body) and not mentions_priority(400, '{"message": "max_tokens must be >= 1"}')


# --- settling answers -------------------------------------------------------------------------------------------


@pytest.fixture
def client(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"custom_id": "a"}\n')
    j = Journal(inp, out, default_errors_path(out), default_state_path(out), "http://127.0.0.1:9")
    j.open([BatchRequest(1, "a", "/v1/completions", {"prompt": "x"})])
    said: list[str] = []
    c = BatchClient(
        "http://127.0.0.1:9", j, ClientOptions(concurrency=8, max_retries=2), on_result=lambda ok: None, say=said.append
    )
    c.said = said
    yield c
    j.close()


def outcome(client, status, body=None, retry_after=None, injected=True, tries=0) -> Outcome:
    item = Item(BatchRequest(1, "a", "/v1/completions", {"prompt": "x"}), tries=tries)
    body = {"choices": [{"text": "t"}], "usage": {"completion_tokens": 3}} if body is None else body
    return Outcome(item, client.window.epoch, status, body, json.dumps(body), "cmpl-9", retry_after, injected)


def read_lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def written(client) -> tuple[list, list]:
    return read_lines(client.journal.output), read_lines(client.journal.errors)


@needs("aiohttp")
def test_429_with_retry_after_pauses_and_halves_once_without_counting_a_try(client):
    first, second = outcome(client, 429, retry_after="2"), outcome(client, 429, retry_after="1")
    assert client.settle(first, now=100.0) is first.item
    assert client.settle(second, now=100.5) is second.item
    assert client.window.allowed == 4 and client.window.paused_until == 102.0
    assert first.item.tries == 0 and client.stats.overloaded == 2 and written(client) == ([], [])


@needs("aiohttp")
def test_503_without_retry_after_backs_off_exponentially(client):
    client.settle(outcome(client, 503), now=0.0)
    client.settle(outcome(client, 503), now=10.0)
    assert client.window.paused_until == 10.0 + backoff_s(2)


@needs("aiohttp")
def test_200_is_journaled_and_widens_the_window(client):
    client.window.on_pressure(client.window.epoch)
    assert client.settle(outcome(client, 200), now=0.0) is None
    out, err = written(client)
    assert [(r["custom_id"], r["response"]["status_code"], r["response"]["request_id"], r["error"]) for r in out] == [
        ("a", 200, "cmpl-9", None)
    ] and err == []
    assert client.window.size == pytest.approx(4.25) and client.stats.completion_tokens == 3


@needs("aiohttp")
def test_a_bad_request_goes_to_the_errors_file_at_once(client):
    body = {"object": "error", "message": "'max_tokens' must be >= 1", "code": 400}
    assert client.settle(outcome(client, 400, body), now=0.0) is None
    assert [(r["response"]["status_code"], r["response"]["body"]) for r in written(client)[1]] == [(400, body)]


@needs("aiohttp")
def test_a_5xx_is_retried_max_retries_times_then_journaled(client):
    out = outcome(client, 500, {"message": "boom"})
    for tries in (1, 2):
        assert client.settle(out, now=0.0) is out.item and out.item.tries == tries
        assert out.item.delay_s == backoff_s(tries)
    assert client.settle(out, now=0.0) is None
    assert written(client)[1][0]["response"]["status_code"] == 500


@needs("aiohttp")
def test_priority_refused_is_dropped_for_the_rest_of_the_job(client):
    assert client.body_for(BatchRequest(1, "a", "/v1/completions", {"prompt": "x"}))[0]["priority"] == 0.0
    out = outcome(client, 400, {"message": "priority: Extra inputs are not permitted"})
    assert client.settle(out, now=0.0) is out.item and out.item.tries == 0
    assert client.stats.priority_dropped and "refuses the 'priority' field" in client.said[0]
    body, injected = client.body_for(BatchRequest(1, "a", "/v1/completions", {"prompt": "x"}))
    assert "priority" not in body and not injected
    # the request's own priority is the user's: sent as given, and its refusal is the request's error
    mine = client.body_for(BatchRequest(1, "a", "/v1/completions", {"prompt": "x", "priority": 0.9}))
    assert mine == ({"prompt": "x", "priority": 0.9}, False)


@needs("aiohttp")
def test_connection_lost_too_often_is_journaled_as_an_error(client):
    out = Outcome(Item(BatchRequest(1, "a", "/v1/completions", {}), tries=2), 0, exc=ConnectionResetError("reset"))
    assert client.settle(out, now=0.0) is None
    err = written(client)[1][0]
    assert err["response"] is None and err["error"]["code"] == "connection_error"
    assert "ConnectionResetError: reset (3 tries)" == err["error"]["message"]
