"""The twin's in-flight batching executor behind a real tritonserver: concurrent streams, cancellation, a tiny KV
pool under max_utilization, the queue limit, perf-metric outputs and the backend's Prometheus families."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

import tritonclient.grpc as grpcclient

from trtpipe.triton.client import Client, GenerateOptions, infer_inputs, text_inputs
from trtpipe.triton.repo import write_repo
from trtpipe.triton.server_process import start_server
from triton_helpers import run_concurrently

pytestmark = [pytest.mark.triton, pytest.mark.slow]

PROMPTS = ["Once upon a time", "Lily wanted to", "Tom had a big red ball.", "One day, a cat saw a bird"]
# 16 blocks of 32 tokens: exactly one max_seq_len (512) sequence, so concurrent requests must pause and resume
OVERRIDES = (
    "triton.streaming=true",
    "triton.scheduler_policy=max_utilization",
    "engine.kv_cache.max_tokens=512",
    "triton.max_queue_size=48",
)


@pytest.fixture(scope="module")
def server(stories_engine, stories_recipe, tmp_path_factory):
    engine = stories_engine(1)
    repo = tmp_path_factory.mktemp("inflight") / "repo"
    write_repo(stories_recipe(*OVERRIDES), engine, engine / "checkpoint", repo)
    with start_server(repo, timeout=240) as s:
        yield s


def metrics(server) -> dict[tuple[str, str], float]:
    """(family, category label value) -> value of the nv_trt_llm_* gauges."""
    text = urllib.request.urlopen(f"http://{server.bind}:{server.ports.metrics}/metrics", timeout=10).read().decode()
    out = {}
    for family, label, value in re.findall(
        r"^(nv_trt_llm_\w+)\{[^}]*?(?:request_type|kv_cache_block_type|"
        r'inflight_batcher_specific_metric|general_type)="(\w+)"[^}]*\} (\S+)$',
        text,
        re.M,
    ):
        out[(family, label)] = float(value)
    return out


def wait_for(server, key, value=None, timeout=10.0, above=None):
    """Poll the metrics port (gauges refresh every stats_check_period_ms) until key == value (or > above)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = metrics(server).get(key)
        if got is not None and (got > above if above is not None else got == value):
            return True
        time.sleep(0.05)
    return False


def _llm_inputs(ids, max_tokens, **extra):
    rows = [
        ("input_ids", np.array([ids], np.int32), "INT32"),
        ("input_lengths", np.array([[len(ids)]], np.int32), "INT32"),
        ("request_output_len", np.array([[max_tokens]], np.int32), "INT32"),
    ]
    rows += [(k, np.array([[v]], dtype=dt), tt) for k, (v, dt, tt) in extra.items()]
    return infer_inputs(grpcclient, rows)


def _bls_inputs(prompt, max_tokens, stream=True):
    return text_inputs(grpcclient, prompt, GenerateOptions(max_tokens=max_tokens, end_id=-1), stream)


def test_sixteen_concurrent_streams_through_a_tiny_pool_are_exact(server, hf_greedy):
    def ask(i):
        with Client(server.grpc_url) as c:
            return "".join(c.stream(PROMPTS[i % 4], GenerateOptions(max_tokens=48 + 8 * (i % 3))))

    results = run_concurrently(ask, 16, timeout=180)
    for i, text in results.items():
        assert text == hf_greedy(PROMPTS[i % 4], 48 + 8 * (i % 3))[1], i
    assert wait_for(server, ("nv_trt_llm_kv_cache_block_metrics", "used"), 0.0)
    assert metrics(server)[("nv_trt_llm_kv_cache_block_metrics", "max")] == 16


def test_forty_cancelled_streams_leave_no_used_blocks(server, hf_stories):
    # 40, below the queue limit of 48 (OVERRIDES): all of them may still wait in the queue when the last one arrives,
    # whatever the executor admitted by then (50 were refused by the limit on a loaded machine).
    tok, _ = hf_stories
    ids = tok("Once upon a time").input_ids
    raw = grpcclient.InferenceServerClient(server.grpc_url)
    first_tokens, errors = threading.Semaphore(0), []
    raw.start_stream(callback=lambda result, error: errors.append(error) if error else first_tokens.release())
    try:
        for i in range(40):
            raw.async_stream_infer(
                "tensorrt_llm",
                _llm_inputs(ids, 200, streaming=(True, bool, "BOOL"), end_id=(-1, np.int32, "INT32")),
                request_id=str(i),
            )
        assert first_tokens.acquire(timeout=60), errors[:1]  # generation is under way
        assert wait_for(server, ("nv_trt_llm_kv_cache_block_metrics", "used"), above=0)
    finally:
        raw.stop_stream(cancel_requests=True)
        raw.close()
    assert wait_for(server, ("nv_trt_llm_kv_cache_block_metrics", "used"), 0.0, timeout=20)
    assert wait_for(server, ("nv_trt_llm_request_metrics", "active"), 0.0)
    # the client's own cancellation is the only error it saw (no server-side failure)
    assert all("Locally cancelled" in str(e) for e in errors), [str(e) for e in errors[:2]]


def test_stop_request_cancels_by_request_id(server, hf_stories):
    """``stop=true`` with a request's id ends that request. The request asks for every token this server allows
    (a streaming request under max_utilization without chunking must fit max_input_len 256, as in TensorRT-LLM:
    251 tokens after the 5 of the prompt, hundreds of steps after its first token, where the stop is sent), so it
    cannot end by itself in the wait; the stop travels on a second stream, so the final awaited on the first
    one is the cancelled request's own (the stop's reply, also carrying the id, lands on the second)."""
    tok, _ = hf_stories
    ids = tok("Once upon a time").input_ids
    max_tokens = 256 - len(ids)
    streamed, finals, stop_replies = [], [], []
    first, ended, stopped = threading.Event(), threading.Event(), threading.Event()

    def on_request(result, error):
        if error is not None:
            finals.append(("error", str(error)))
            ended.set()
            return
        resp = result.get_response(as_json=True)
        out = result.as_numpy("output_ids")
        if out is not None:
            streamed.extend(int(t) for t in out.reshape(-1))
            first.set()
        if resp["parameters"].get("triton_final_response", {}).get("bool_param"):
            finals.append((resp["id"], [o["name"] for o in resp.get("outputs", [])]))
            ended.set()

    def on_stop(result, error):
        stop_replies.append(error if error is not None else result.get_response(as_json=True))
        stopped.set()

    raw, control = (grpcclient.InferenceServerClient(server.grpc_url) for _ in range(2))
    raw.start_stream(callback=on_request)
    control.start_stream(callback=on_stop)
    try:
        raw.async_stream_infer(
            "tensorrt_llm",
            _llm_inputs(ids, max_tokens, streaming=(True, bool, "BOOL"), end_id=(-1, np.int32, "INT32")),
            request_id="long",
            enable_empty_final_response=True,
        )
        assert first.wait(60), ("no first token", finals)
        control.async_stream_infer("tensorrt_llm", _llm_inputs(ids, 1, stop=(True, bool, "BOOL")), request_id="long")
        assert ended.wait(120), "no final response for the request"
        assert stopped.wait(60), "no reply to the stop request"
    finally:
        raw.stop_stream()
        control.stop_stream()
        raw.close()
        control.close()
    # the cancelled request's own final: a flag-only response (no tensors) for its id, as after a last token
    assert finals == [("long", [])], finals
    assert 0 < len(streamed) < max_tokens, len(streamed)  # cut short: it did not run to its length
    assert wait_for(server, ("nv_trt_llm_request_metrics", "active"), 0.0)
    (reply,) = stop_replies  # the stop's own reply: final, for the same id, without output tensors
    assert not isinstance(reply, Exception), reply
    assert reply["id"] == "long" and not reply.get("outputs")


def test_queue_full_is_refused_at_once(server):
    errors, answers = [], []
    lock = threading.Lock()

    def ask():
        try:
            with Client(server.grpc_url) as c:
                c.generate("Once upon a time", GenerateOptions(max_tokens=200, end_id=-1))
            with lock:
                answers.append(1)
        except Exception as exc:  # noqa: BLE001 - the refusals are the point
            with lock:
                errors.append((time.monotonic(), str(exc)))

    t0 = time.monotonic()
    threads = [threading.Thread(target=ask) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    full = [(t, e) for t, e in errors if "Maximum queue size of 48 has been reached" in e]
    assert full, errors[:3]
    assert len(full) == len(errors), errors[:3]  # nothing else failed
    assert min(t for t, _ in full) - t0 < 5.0  # refused at once, not after waiting for a slot
    assert len(answers) + len(full) == 64


def test_perf_metric_outputs(server, hf_stories):
    tok, _ = hf_stories
    ids = tok("Once upon a time").input_ids
    with grpcclient.InferenceServerClient(server.grpc_url) as raw:
        done, out = threading.Event(), []
        raw.start_stream(callback=lambda result, error: (out.append((result, error)), done.set()))
        raw.async_stream_infer(
            "tensorrt_llm",
            _llm_inputs(
                ids, 8, return_perf_metrics=(True, bool, "BOOL"), return_num_output_tokens=(True, bool, "BOOL")
            ),
        )
        assert done.wait(30)
        raw.stop_stream()
    result, error = out[0]
    assert error is None, error
    t = {
        n: int(result.as_numpy(n).reshape(-1)[0])
        for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    }
    assert (
        0 < t["arrival_time_ns"] <= t["first_scheduled_time_ns"] < t["first_token_time_ns"] <= t["last_token_time_ns"]
    )
    assert int(result.as_numpy("num_output_tokens").reshape(-1)[0]) == 8
    assert int(result.as_numpy("kv_cache_alloc_total_blocks").reshape(-1)[0]) >= 1


def test_bls_returns_the_server_measurements_when_asked(server):
    import http.client
    import json

    host, port = server.http_url.replace("http://", "").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {
        "text_input": "Once upon a time",
        "max_tokens": 8,
        "end_id": -1,
        "stream": True,
        "return_perf_metrics": True,
        "return_num_output_tokens": True,
    }
    conn.request("POST", "/v2/models/tensorrt_llm_bls/generate_stream", json.dumps(body))
    events = [json.loads(line[5:]) for line in conn.getresponse() if line.startswith(b"data:")]
    conn.close()
    last = events[-1]
    assert "error" not in last, last
    assert last["num_output_tokens"] == 8
    assert (
        0
        < last["arrival_time_ns"]
        <= last["first_scheduled_time_ns"]
        < last["first_token_time_ns"]
        <= last["last_token_time_ns"]
    )
    assert all("arrival_time_ns" not in e for e in events[:-1])  # measurements come once, with the last response


def test_cancelled_bls_streams_end_cleanly_and_the_server_keeps_serving(server, hf_greedy):
    """A client that leaves BLS streams mid-way: the inner tensorrt_llm requests are cancelled and drained, their
    blocks come back, and later requests are answered (an unread inner stream used to stall the server)."""
    for _ in range(3):
        raw = grpcclient.InferenceServerClient(server.grpc_url)
        pieces = threading.Semaphore(0)
        raw.start_stream(callback=lambda result, error: pieces.release())
        for k in range(6):
            raw.async_stream_infer("tensorrt_llm_bls", _bls_inputs(PROMPTS[k % 4], 200), request_id=f"c{k}")
        assert pieces.acquire(timeout=60)
        raw.stop_stream(cancel_requests=True)
        raw.close()
    assert wait_for(server, ("nv_trt_llm_kv_cache_block_metrics", "used"), 0.0, timeout=30)
    with Client(server.grpc_url) as c:
        assert (
            "".join(c.stream("Once upon a time", GenerateOptions(max_tokens=24)))
            == hf_greedy("Once upon a time", 24)[1]
        )


def test_cancelled_streams_end_with_their_final_so_the_server_keeps_nothing_of_them(server, hf_stories):
    """tritonserver keeps a stream's state until the model sends its final flag, also after the client cancelled:
    a twin that skipped it left about 40 KB behind per cancelled stream (measured: +8 MB over 200 here).

    The requests are not streamed, so the twin has nothing to send when the cancel arrives: tritonserver 2.51's
    gRPC stream handler takes two locks in opposite orders when it writes a response while it handles a cancel,
    and can hang or crash (docs/reference/serving.md); the final flag then goes out after the server has taken the cancel in.
    Straight to tensorrt_llm: through the BLS a cancelled request costs a step or more of the twin, so 80 cancels
    a second pile up a backlog whose memory would hide what this measures.
    """
    tok, _ = hf_stories
    ids = tok("Once upon a time").input_ids

    def cancel_mid_generation(i):
        """True if the request was still running when the client cancelled it."""
        inputs = _llm_inputs(ids, 300, streaming=(False, bool, "BOOL"), end_id=(-1, np.int32, "INT32"))
        raw = grpcclient.InferenceServerClient(server.grpc_url)
        answered = threading.Event()
        raw.start_stream(callback=lambda result, error: answered.set())
        try:
            raw.async_stream_infer("tensorrt_llm", inputs, request_id=f"x{i}")
            time.sleep(0.05)  # 300 tokens take far longer
            return not answered.is_set()
        finally:
            raw.stop_stream(cancel_requests=True)
            raw.close()

    def rounds(n):
        cancelled = 0
        for start in range(0, n, 4):
            cancelled += sum(run_concurrently(lambda k: cancel_mid_generation(start + k), 4, timeout=120).values())
        assert wait_for(server, ("nv_trt_llm_request_metrics", "active"), 0.0, timeout=60)
        return cancelled

    rounds(40)  # warm-up: thread pools, arenas and caches reach their working size
    before = psutil.Process(server.pid).memory_info().rss / 2**20
    assert rounds(200) >= 180  # cancelled while running, not after the answer
    grown = psutil.Process(server.pid).memory_info().rss / 2**20 - before
    assert grown < 3.0, f"tritonserver grew {grown:.1f} MB over 200 cancelled streams"
    with Client(server.grpc_url) as c:  # and it still answers
        assert c.generate("Once upon a time", GenerateOptions(max_tokens=8))


def test_an_unstreamed_bls_request_does_not_hold_up_the_next(server):
    """The BLS reads tensorrt_llm as a stream also for a client that does not stream: a thread waiting for one
    whole answer kept every later request out of the BLS until it came (a short request waited for a long one)."""
    done = []

    def ask(max_tokens):
        with Client(server.grpc_url, model="tensorrt_llm_bls") as c:
            assert c.generate("Once upon a time", GenerateOptions(max_tokens=max_tokens))
        done.append(max_tokens)

    long = threading.Thread(target=ask, args=(240,))  # 5 + 240 tokens fit max_input_len: streamable here
    long.start()
    deadline = time.monotonic() + 30
    while not wait_for(server, ("nv_trt_llm_request_metrics", "active"), 1.0, timeout=0.5):
        assert time.monotonic() < deadline, "the long request never started"
    ask(4)
    long.join(60)
    assert done == [4, 240]


def test_unstreamed_bls_answers_with_the_prompt_when_asked(server, hf_stories, hf_greedy):
    """Read as a stream or not (5 + 300 tokens may outgrow max_input_len under max_utilization without chunked
    context, where the executor refuses streaming), an unstreamed BLS answer is the same, prompt included."""
    tok, _ = hf_stories
    for max_tokens in (40, 300):
        new, expected = hf_greedy("Lily wanted to", max_tokens)
        with Client(server.grpc_url, model="tensorrt_llm_bls") as c:
            assert c.generate("Lily wanted to", GenerateOptions(max_tokens=max_tokens)) == expected
            full = c.generate("Lily wanted to", GenerateOptions(max_tokens=max_tokens, exclude_input_in_output=False))
        assert full == tok.decode(tok.encode("Lily wanted to") + new, skip_special_tokens=True), max_tokens


def test_a_full_queue_sheds_the_lower_priority_through_the_server(server, hf_stories):
    """The twin's ``priority`` input reaches the executor's queue: with the queue (48) full of priority-0.1
    requests, each priority-0.9 request sheds a queued low one (which gets the shed error) instead of being refused,
    and is answered (Triton's own request priority, ``priority=`` of tritonclient, orders only Triton's queue: the
    python backend hands a model no request priority, and the tensorrtllm backend never sets one). The low requests are long (400 tokens through a one-sequence pool, so nothing leaves the queue
    while the high ones arrive); the ones beyond the queue are refused as before."""
    tok, _ = hf_stories
    ids = tok("Once upon a time").input_ids
    lock, finals, errors, done = threading.Lock(), {}, [], threading.Semaphore(0)

    def on_response(result, error):
        with lock:
            if error is not None:
                errors.append(str(error))
            else:
                finals[result.get_response().id] = result.as_numpy("output_ids")
        done.release()

    raw = grpcclient.InferenceServerClient(server.grpc_url)
    raw.start_stream(callback=on_response)
    try:
        # Lows until the executor itself refuses one: its queue (48) is then full, and stays full (400 tokens
        # through a one-sequence pool: nothing leaves it while the highs arrive). Triton's own queue in front of the
        # model has the same bound and refuses too while the stub is busy, so a fixed number of lows could leave the
        # executor's queue short (no shed) on one machine and Triton's queue full (a high refused) on another.
        sent, deadline = 0, time.monotonic() + 120
        while True:
            with lock:
                if any("Maximum queue size of 48 has been reached" in e for e in errors):
                    break
            assert sent < 400 and time.monotonic() < deadline, (sent, errors[:2])
            raw.async_stream_infer(
                "tensorrt_llm",
                _llm_inputs(ids, 400, end_id=(-1, np.int32, "INT32"), priority=(0.1, np.float32, "FP32")),
                request_id=f"low{sent}",
            )
            sent += 1
            time.sleep(0.01)  # pacing only: the loop ends on the executor's refusal, not on a count
        # then every low sent is accounted for (running, in the full queue, or answered), so Triton's queue is empty
        # and the highs reach the executor
        while True:
            active = metrics(server).get(("nv_trt_llm_request_metrics", "active"), 0)
            with lock:
                answered = len(errors) + len(finals)
            if active + 48 + answered == sent:
                break
            assert time.monotonic() < deadline, (sent, active, answered)
            time.sleep(0.05)
        for i in range(4):
            raw.async_stream_infer(
                "tensorrt_llm",
                _llm_inputs(ids, 8, end_id=(-1, np.int32, "INT32"), priority=(0.9, np.float32, "FP32")),
                request_id=f"high{i}",
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(f"high{i}" in finals for i in range(4)):
            done.acquire(timeout=1)
        with lock:  # before the low requests still running are cancelled by the client below
            got, seen = dict(finals), list(errors)
    finally:
        raw.stop_stream(cancel_requests=True)
        raw.close()
    for i in range(4):
        assert f"high{i}" in got and got[f"high{i}"].size == 8, (i, seen[:2])
    shed = [e for e in seen if "shed for a request of higher priority than 0.1" in e]
    # refusals of the executor's queue, or of Triton's own in front of it (the same max_queue_size)
    refused = [
        e
        for e in seen
        if ("Maximum queue size of 48 has been reached" in e and "shed" not in e) or "Exceeds maximum queue size" in e
    ]
    # the first high request finds the queue full and sheds; later ones may find the slot the first left when it
    # was admitted ahead of the running low ones (priority overflow): none of them is refused either way
    assert 1 <= len(shed) <= 4, (len(shed), seen[:3])
    assert len(refused) + len(shed) == len(seen), [e for e in seen if e not in refused + shed]
    assert wait_for(server, ("nv_trt_llm_request_metrics", "active"), 0.0, timeout=60)
