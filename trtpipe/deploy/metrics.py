"""The metric names each server exports, as the one table the rules, the dashboard and the autoscaler read.

``engine`` is tritonserver with the ``tensorrtllm`` backend (rank 0's ``:8002/metrics``): Triton core's
``nv_inference_*`` families (labels ``model``, ``version``) and the backend's ``nv_trt_llm_*`` gauges
(triton-inference-server/tensorrtllm_backend ``inflight_batcher_llm/src/custom_metrics_reporter``; the CPU twin
exports the same families and labels, :mod:`trtpipe.serving.triton_adapter`). ``llmapi`` is ``trtllm-serve`` with
``return_perf_metrics: true`` (``/prometheus/metrics``; NVIDIA/TensorRT-LLM@050f80de
``tensorrt_llm/metrics/collector.py``; the OpenAI twin exports the subset listed here with the same buckets).

:data:`NOT_IN_TWINS` lists the names the dashboard or rules use that the CPU twins cannot export, with why; every
other name is checked against a live scrape of both twins (tests/deploy, tests/triton_serving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ServerMetrics:
    """One server's metric vocabulary (PromQL fragments over ``{sel}``, the job/model selector)."""

    server: str
    path: str  # metrics path on the metrics port
    port: int  # container port that serves ``path``
    ttft_bucket: str  # histogram of time to first token
    ttft_scale: float  # multiply the histogram's unit into seconds
    itl_bucket: Optional[str]  # histogram of time per output token (None: the server exports none)
    queue_seconds: str  # counter: cumulative queue time (seconds after scaling)
    compute_seconds: str  # counter expression: cumulative compute time
    kv_fraction: str  # gauge: used / max KV blocks
    kv_reuse: str  # gauge or expression: KV reuse
    waiting: str  # gauge: requests waiting for a slot
    running: str  # gauge: requests in the batch
    success: str  # counter of finished requests
    failure: str  # counter of failed requests
    output_tokens: str  # counter of generated tokens
    gpu_memory: str  # GPU memory in use (bytes)
    # speculative decoding: cumulative draft tokens proposed and accepted (None: the server exports none)
    spec_drafts: Optional[str] = None
    spec_accepted: Optional[str] = None


ENGINE = ServerMetrics(
    server="tritonserver",
    path="/metrics",
    port=8002,
    ttft_bucket="nv_inference_first_response_histogram_ms_bucket{%(client)s}",
    ttft_scale=1e-3,
    itl_bucket=None,  # Triton core and the tensorrtllm backend export no per-token latency
    queue_seconds="nv_inference_queue_duration_us{%(engine)s}",
    compute_seconds="nv_inference_compute_infer_duration_us{%(engine)s}",
    kv_fraction='nv_trt_llm_kv_cache_block_metrics{%(job)s,kv_cache_block_type="fraction"}',
    kv_reuse='nv_trt_llm_kv_cache_block_metrics{%(job)s,kv_cache_block_type="reused"}',
    waiting='nv_trt_llm_request_metrics{%(job)s,request_type="waiting"}',
    running='nv_trt_llm_request_metrics{%(job)s,request_type="scheduled"}',
    success="nv_inference_request_success{%(client)s}",
    failure="nv_inference_request_failure{%(client)s}",
    output_tokens="nv_llm_output_token_len_sum{%(job)s}",
    gpu_memory="nv_gpu_memory_used_bytes{%(job)s}",
)

LLMAPI = ServerMetrics(
    server="trtllm-serve",
    path="/prometheus/metrics",
    port=8000,
    ttft_bucket="trtllm_time_to_first_token_seconds_bucket{%(job)s}",
    ttft_scale=1.0,
    itl_bucket="trtllm_time_per_output_token_seconds_bucket{%(job)s}",
    queue_seconds="trtllm_request_queue_time_seconds_sum{%(job)s}",
    compute_seconds="trtllm_e2e_request_latency_seconds_sum{%(job)s}",  # minus the queue time (see alerts)
    kv_fraction="trtllm_kv_cache_utilization{%(job)s}",
    kv_reuse="trtllm_kv_cache_hit_rate{%(job)s}",
    waiting="trtllm_num_requests_waiting{%(job)s}",
    running="trtllm_num_requests_running{%(job)s}",
    success="trtllm_request_success_total{%(job)s}",
    failure="trtllm_request_error_total{%(job)s}",
    output_tokens="trtllm_generation_tokens_total{%(job)s}",
    gpu_memory="DCGM_FI_DEV_FB_USED{%(job)s} * 1048576",
    # the OpenAI twin's names (trtpipe/serving/speculative.py prometheus_lines, after vLLM's
    # spec_decode_num_*_total): trtllm-serve's /prometheus/metrics has no acceptance counter to copy, so on a real
    # trtllm-serve these series are absent and the drift alert stays silent
    spec_drafts="trtllm_spec_decode_draft_tokens_total{%(job)s}",
    spec_accepted="trtllm_spec_decode_accepted_tokens_total{%(job)s}",
)

BY_TARGET = {"engine": ENGINE, "llmapi": LLMAPI}

# Per-adapter counters (label ``lora_name``) of the OpenAI twin (trtpipe.serving.lora_metrics writes them).
# trtllm-serve exports no LoRA metric (tensorrt_llm/metrics/collector.py@050f80de lists none): against it the
# per-adapter rules stay empty.
LORA = {
    "requests": "trtpipe_lora_request_success_total",
    "output_tokens": "trtpipe_lora_generation_tokens_total",
    "cache_hits": "trtpipe_lora_cache_hits_total",
    "cache_misses": "trtpipe_lora_cache_misses_total",
    "cache_loads": "trtpipe_lora_cache_loads_total",
}

# DCGM exporter's framebuffer use (MiB), when dcgm-exporter runs beside the servers (NVIDIA/dcgm-exporter
# etc/default-counters.csv: DCGM_FI_DEV_FB_USED).
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"

NOT_IN_TWINS = {
    "nv_inference_first_response_histogram_ms_bucket": "Triton with --metrics-config histogram_latencies=true; "
    "the twin's tritonserver 2.51 (nvidia-pytriton 0.7.0) has no histogram_latencies setting",
    "nv_gpu_memory_used_bytes": "Triton's GPU metrics need a GPU",
    DCGM_FB_USED: "dcgm-exporter needs a GPU",
    "up": "written by Prometheus for every scrape target, not by the server",
}


def selectors(job: str, client_model: str, engine_model: str = "tensorrt_llm") -> dict[str, str]:
    """The label matchers the fragments use: ``job``, plus Triton's ``model`` label of the model clients call
    (TTFT, successes, failures) and of the engine model (queue and compute time)."""
    j = f'job="{job}"'
    return {"job": j, "client": f'{j},model="{client_model}"', "engine": f'{j},model="{engine_model}"'}
