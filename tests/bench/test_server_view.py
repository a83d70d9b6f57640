"""The server view: Prometheus parsing, counter deltas, gauge summaries and the limiter rules.

The metric names and labels are those tritonserver 2.51 prints (Triton core families) and those the
TensorRT-LLM backend's custom metrics reporter publishes (nv_trt_llm_* with one category label each), so
the view lights up unchanged when a server exports them.
"""

from __future__ import annotations

from trtpipe.bench.server_view import (
    counter_deltas,
    gauge_summary,
    gauge_values,
    histogram_deltas,
    limiter,
    model_breakdown,
    parse,
    server_tokens,
    server_view,
)

BEFORE = """# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="tensorrt_llm",version="1"} 2
nv_inference_request_success{model="tensorrt_llm_bls",version="1"} 2
nv_inference_request_failure{model="tensorrt_llm_bls",reason="BACKEND",version="1"} 0
nv_inference_count{model="tensorrt_llm",version="1"} 2
nv_inference_exec_count{model="tensorrt_llm",version="1"} 2
nv_inference_request_duration_us{model="tensorrt_llm",version="1"} 100000
nv_inference_queue_duration_us{model="tensorrt_llm",version="1"} 1000
nv_inference_request_duration_us{model="tensorrt_llm_bls",version="1"} 120000
nv_inference_queue_duration_us{model="tensorrt_llm_bls",version="1"} 500
nv_llm_output_token_len_sum{model="tensorrt_llm",response_metric_type="total_output_tokens",version="1"} 64
nv_llm_output_token_len_count{model="tensorrt_llm",response_metric_type="total_output_tokens",version="1"} 2
"""
AFTER = """nv_inference_request_success{model="tensorrt_llm",version="1"} 12
nv_inference_request_success{model="tensorrt_llm_bls",version="1"} 11
nv_inference_request_failure{model="tensorrt_llm_bls",reason="BACKEND",version="1"} 1
nv_inference_count{model="tensorrt_llm",version="1"} 12
nv_inference_exec_count{model="tensorrt_llm",version="1"} 7
nv_inference_request_duration_us{model="tensorrt_llm",version="1"} 600000
nv_inference_queue_duration_us{model="tensorrt_llm",version="1"} 11000
nv_inference_request_duration_us{model="tensorrt_llm_bls",version="1"} 1120000
nv_inference_queue_duration_us{model="tensorrt_llm_bls",version="1"} 600500
nv_llm_output_token_len_sum{model="tensorrt_llm",response_metric_type="total_output_tokens",version="1"} 384
nv_llm_output_token_len_count{model="tensorrt_llm",response_metric_type="total_output_tokens",version="1"} 12
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5
"""


def test_parse_reads_labels_and_values():
    s = parse(BEFORE + 'weird{a="x\\"y",b="2"} 1.5e3\n')
    assert s[("nv_inference_request_success", (("model", "tensorrt_llm"), ("version", "1")))] == 2.0
    assert s[("weird", (("a", 'x\\"y'), ("b", "2")))] == 1500.0


def test_counter_deltas_and_per_model_means():
    d = counter_deltas(parse(BEFORE), parse(AFTER))
    assert d["tensorrt_llm"]["nv_inference_request_success"] == 10
    assert d["tensorrt_llm_bls"]["nv_inference_request_failure:BACKEND"] == 1
    m = model_breakdown(d)
    assert m["tensorrt_llm"]["queue_ms"] == 10000 / 10 / 1000  # 1 ms per request
    assert m["tensorrt_llm"]["request_ms"] == 50.0
    assert m["tensorrt_llm"]["avg_batch"] == 10 / 5
    assert m["tensorrt_llm_bls"]["failures"] == 1 and m["tensorrt_llm_bls"]["requests"] == 9
    assert m["tensorrt_llm_bls"]["queue_ms"] == 600000 / 10 / 1000  # failures count in the denominator


def test_server_token_total_from_the_histogram_delta():
    h = histogram_deltas(parse(BEFORE), parse(AFTER))
    assert h["nv_llm_output_token_len"] == {"sum": 320.0, "count": 10.0}
    assert server_tokens({"histograms": h}) == 320.0
    assert server_tokens({"histograms": {}}) is None


def _gauges(**values):
    lines = []
    for key, v in values.items():
        fam, cat = key.split("__")
        label = {
            "nv_trt_llm_request_metrics": "request_type",
            "nv_trt_llm_kv_cache_block_metrics": "kv_cache_block_type",
        }[fam]
        lines.append(f'{fam}{{model="tensorrt_llm",{label}="{cat}",version="1"}} {v}')
    return gauge_values(parse("\n".join(lines)))


def test_limiter_names_kv_then_batch_then_waiting_then_queueing():
    def view(g, models=None):
        series = [(i, g) for i in range(4)]
        return {"gauges": gauge_summary(series, 0, 10), "models": models or {}}

    kv = _gauges(
        nv_trt_llm_kv_cache_block_metrics__fraction=0.97,
        nv_trt_llm_request_metrics__scheduled=8,
        nv_trt_llm_request_metrics__max=8,
    )
    assert limiter(view(kv))["limiter"] == "kv_blocks_full"
    full = _gauges(
        nv_trt_llm_kv_cache_block_metrics__fraction=0.3,
        nv_trt_llm_request_metrics__scheduled=8,
        nv_trt_llm_request_metrics__max=8,
    )
    assert limiter(view(full))["limiter"] == "batch_slots_full"
    wait = _gauges(
        nv_trt_llm_kv_cache_block_metrics__fraction=0.3,
        nv_trt_llm_request_metrics__scheduled=2,
        nv_trt_llm_request_metrics__max=8,
        nv_trt_llm_request_metrics__waiting=3,
    )
    assert limiter(view(wait))["limiter"] == "executor_waiting"
    models = model_breakdown(counter_deltas(parse(BEFORE), parse(AFTER)))
    q = limiter(view({}, models))
    assert q["limiter"] == "queueing" and q["model"] == "tensorrt_llm_bls"  # 60% of its time queued
    calm = {k: {**v, "queue_ms": 0.0} for k, v in models.items()}
    assert limiter(view({}, calm))["limiter"] == "none"
    assert limiter(view({}, {}))["limiter"] == "unknown"
    tiny = {
        "postprocessing": {"queue_ms": 0.3, "request_ms": 0.8},
        "tensorrt_llm": {"queue_ms": 0.1, "request_ms": 300},
    }
    assert limiter({**view({}, tiny), "client_e2e_ms": 400.0})["limiter"] == "none"  # 45% of 0.8 ms is nothing
    waits = {"tensorrt_llm": {"queue_ms": 80.0, "request_ms": 900.0}}
    assert limiter({**view({}, waits), "client_e2e_ms": 400.0})["model"] == "tensorrt_llm"  # 20% of what clients see


def test_gauge_summary_uses_only_samples_inside_the_run():
    series = [(0, {"pending:m": 9.0}), (5, {"pending:m": 1.0}), (6, {"pending:m": 3.0}), (20, {"pending:m": 9.0})]
    g = gauge_summary(series, 4, 10)
    assert g["pending:m"] == {"mean": 2.0, "max": 3.0, "samples": 2}


def test_server_view_without_trt_llm_families():
    v = server_view(parse(BEFORE), parse(AFTER), [], 0, 1)
    assert v["trt_llm_metrics"] is False and v["limiter"] == "queueing"
