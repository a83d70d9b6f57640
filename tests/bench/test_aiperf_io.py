"""AIPerf's inputs and outputs as trtpipe writes and reads them: the payload template, the command line, and
one per-request record in the layout AIPerf 0.13.0 exports (``profile_export.jsonl``)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from trtpipe.bench.aiperf import Load, command, parse_record
from trtpipe.app.bench_run import default_lengths, make_loads
from trtpipe.bench.metrics import BenchError
from trtpipe.bench.target import Target

# Shape of one record of AIPerf 0.13.0 (streaming, template endpoint), values shortened.
RECORD = {
    "metadata": {"request_start_ns": 1_000_000_000, "request_end_ns": 1_103_923_374, "benchmark_phase": "profiling"},
    "metrics": {
        "output_sequence_length": {"value": 4, "unit": "tokens"},
        "time_to_first_token": {"value": 36.5, "unit": "ms"},
        "request_latency": {"value": 103.9, "unit": "ms"},
        "inter_chunk_latency": {"value": [20.0, 0.0, 47.4], "unit": "ms"},
    },
}


def target(inputs=("text_input", "max_tokens", "stream", "end_id"), streaming=True):
    return Target(
        "http://127.0.0.1:9",
        "tensorrt_llm_bls",
        streaming,
        "/tok",
        max_input_len=256,
        max_seq_len=512,
        inputs=list(inputs),
    )


def render(t: Target, osl: int, text: str, max_tokens):
    return json.loads(jinja2.Template(t.template_text(osl)).render(text=text, max_tokens=max_tokens))


def test_template_forces_the_output_length_with_what_the_model_declares():
    body = render(target(), 32, 'say "hi", then stop', 32)
    assert body == {"text_input": 'say "hi", then stop', "max_tokens": 32, "stream": True, "end_id": -1}
    assert render(target(), 32, "x", None)["max_tokens"] == 32
    with_min = target(
        inputs=("text_input", "max_tokens", "min_tokens", "end_id", "return_perf_metrics", "return_num_output_tokens"),
        streaming=False,
    )
    body = render(with_min, 16, "x", 16)
    assert body == {
        "text_input": "x",
        "max_tokens": 16,
        "min_tokens": 16,
        "return_perf_metrics": True,
        "return_num_output_tokens": True,
    }
    assert "end_id" not in json.loads(
        jinja2.Template(target().template_text(8, fixed_output=False)).render(text="x", max_tokens=8)
    )


def test_command_line(tmp_path):
    load = Load(
        concurrency=None,
        request_rate=2.5,
        arrival="constant",
        requests=None,
        duration_s=30,
        isl=64,
        osl=16,
        warmup_requests=3,
    )
    cmd = command(Path("/bin/aiperf"), target(), load, tmp_path, tmp_path / "t.json", {"ttft": 200.0, "itl": 50.0})
    s = " ".join(cmd)
    assert "--custom-endpoint /v2/models/tensorrt_llm_bls/generate_stream" in s and "--streaming" in s
    assert "--request-rate 2.5 --arrival-pattern constant" in s and "--benchmark-duration 30" in s
    assert "--warmup-request-count 3" in s and "--concurrency" not in s
    assert cmd[cmd.index("--goodput") + 1] == "time_to_first_token:200 inter_token_latency:50"
    assert f"payload_template:{tmp_path / 't.json'}" in cmd
    nostream = command(
        Path("/bin/aiperf"), target(streaming=False), Load(concurrency=2, requests=4), tmp_path, tmp_path / "t.json"
    )
    assert "/v2/models/tensorrt_llm_bls/generate" in nostream and "--streaming" not in nostream


def test_record_rebuilds_response_times_on_the_client_clock():
    r = parse_record(RECORD)
    assert r.ok and r.osl == 4 and r.start_ns == 1_000_000_000
    assert r.responses_ns == [1_036_500_000, 1_056_500_000, 1_056_500_000, 1_103_900_000]  # last = latency
    err = parse_record({"metadata": {"request_start_ns": 5}, "error": {"code": 400, "message": 'data: {"error": "x"}'}})
    assert not err.ok and err.error == 'data: {"error": "x"}'


def test_lengths_stay_within_the_engine():
    t = target()
    assert default_lengths(t, None, None) == (128, 64)
    small = Target("http://h:1", "m", True, "/tok", max_input_len=16, max_seq_len=40)
    assert default_lengths(small, None, None) == (16, 24)
    with pytest.raises(BenchError, match="max_input_len 256"):
        t.check_lengths(300, 8)
    with pytest.raises(BenchError, match="max_seq_len 512"):
        t.check_lengths(200, 300, isl_stddev=10)


def test_loads_of_a_sweep():
    loads = make_loads([1, 2, 4], None, "poisson", None, None, 2, 16, 8, 0, 0)
    assert [x.label() for x in loads] == ["c1", "c2", "c4"] and loads[0].requests == 32
    rates = make_loads([8], [1.0, 2.5], "constant", 10, None, 0, 16, 8, 0, 0)
    assert [x.label() for x in rates] == ["rate1-constant-c8", "rate2.5-constant-c8"]
    with pytest.raises(BenchError, match="not both"):
        make_loads([1, 2], [1.0], "poisson", 10, None, 0, 16, 8, 0, 0)


def test_server_split_from_streamed_perf_outputs():
    from trtpipe.bench.aiperf import _server_fields
    from trtpipe.bench.metrics import server_split

    # two streamed responses as SSE text, the way the generate_stream endpoint sends them
    ev = [
        {"text_output": "a", "num_output_tokens": 1},
        {
            "text_output": "bc",
            "num_output_tokens": 2,
            "arrival_time_ns": 1_000_000,
            "first_scheduled_time_ns": 3_000_000,
            "first_token_time_ns": 10_000_000,
            "last_token_time_ns": 25_000_000,
        },
    ]
    found: list = []
    _server_fields([{"perf_ns": 1, "text": "data: " + json.dumps(e) + "\n\n"} for e in ev], found)
    split = server_split(found, client_ttft_ms=12.5)
    assert split == {
        "num_output_tokens": 3,
        "server_queue": 2.0,
        "server_prefill": 7.0,
        "server_decode": 15.0,
        "outside_executor": 12.5 - 9.0,
    }
    assert server_split([{"text_output": "x"}], 5.0) == {}
