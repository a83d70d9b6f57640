"""Per-adapter series on the OpenAI twin's ``/prometheus/metrics``: requests, prompt and generation tokens, and the
adapter cache's loads, hits, misses and evictions, each labelled ``lora_name``; plus the LoRA info gauge that
adapter-aware routers read.

Names, and where they come from:
- TensorRT-LLM exports no LoRA metric: the full list of trtllm-serve's families in
  ``tensorrt_llm/metrics/collector.py@050f80de`` (``MetricsCollector``'s docstring) names none, and neither does
  the Triton backend's ``nv_trt_llm_*`` set. The names here are trtpipe's own (``trtpipe_lora_*``), so nothing
  reads as an upstream family it is not.
- The info gauge follows vLLM's ``vllm:lora_requests_info`` (``vllm/v1/metrics/loggers.py@005a810b``,
  ``PrometheusStatLogger``): labels ``max_lora``, ``running_lora_adapters``, ``waiting_lora_adapters`` (adapter
  names joined by commas), value the unix time of the step it describes. That is the label format the Gateway API
  Inference Extension's endpoint picker requires of any model server for LoRA affinity
  (kubernetes-sigs/gateway-api-inference-extension@2b934d03 ``docs/proposals/003-model-server-protocol/README.md``,
  "LoRA Adapter Serving": metric names may differ, types and labels may not); the picker takes its name from a flag
  (``--lora-info-metric``, "must be in vLLM label format", ``cmd/epp/runner/runner.go@e8a01172``; later releases
  move it into the picker's config file, not read here), so it is exported as ``trtpipe_lora_requests_info``.
- Running adapters: those of the latest step that still have requests in flight; waiting: adapters with requests in
  flight that the latest step did not run (queued, or deferred by ``max_loras``).
- Base-model requests carry no ``lora_name``: they are the ``trtllm_*`` totals minus the sum over adapters.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

# name -> (type, help): every family this module writes
FAMILIES = {
    "trtpipe_lora_requests_info": ("gauge", "Running stats on LoRA requests (vLLM's vllm:lora_requests_info labels)."),
    "trtpipe_lora_request_success_total": ("counter", "Finished requests per adapter and finish reason."),
    "trtpipe_lora_request_error_total": ("counter", "Failed requests per adapter."),
    "trtpipe_lora_prompt_tokens_total": ("counter", "Prompt tokens of finished requests per adapter."),
    "trtpipe_lora_generation_tokens_total": ("counter", "Generated tokens of finished requests per adapter."),
    "trtpipe_lora_cache_loads_total": ("counter", "Adapter reads from its directory (host cache misses)."),
    "trtpipe_lora_cache_hits_total": ("counter", "Steps that found the adapter in the device cache."),
    "trtpipe_lora_cache_misses_total": ("counter", "Steps that had to activate the adapter into the device cache."),
    "trtpipe_lora_cache_evictions_total": ("counter", "Adapters evicted, per cache (device, host)."),
}


def label_value(text: str) -> str:
    """A label value in the text exposition format: backslash, double quote and newline escaped."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class LoraCounters:
    """Per-adapter request counters of one front end (updated on the event loop, read by the scrape)."""

    success: Counter = field(default_factory=Counter)  # (lora, finish reason) -> requests
    errors: Counter = field(default_factory=Counter)
    prompt_tokens: Counter = field(default_factory=Counter)
    generation_tokens: Counter = field(default_factory=Counter)
    in_flight: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def begin(self, lora: Optional[str]) -> None:
        if lora is not None:
            with self._lock:
                self.in_flight[lora] += 1

    def end(self, lora: Optional[str]) -> None:
        if lora is not None:
            with self._lock:
                self.in_flight[lora] -= 1
                if self.in_flight[lora] <= 0:
                    del self.in_flight[lora]

    def account(self, lora: Optional[str], failed: bool, finish: Optional[str], prompt: int, generated: int) -> None:
        """One finished (or failed) request of adapter ``lora`` (None: the base model, not counted here)."""
        if lora is None:
            return
        with self._lock:
            if failed:
                self.errors[lora] += 1
                return
            self.success[lora, finish or "error"] += 1
            self.prompt_tokens[lora] += prompt
            self.generation_tokens[lora] += generated


def _family(name: str) -> list[str]:
    kind, text = FAMILIES[name]
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


def prometheus_lines(counters: LoraCounters, engine, labels: str, max_loras: int) -> list[str]:
    """The per-adapter families over ``labels`` (the server's own ``model_name``/``engine_type`` pairs).

    ``engine``: the :class:`~trtpipe.serving.adapters.LoraStepEngine` (its cache and its latest step)."""
    stats = engine.cache.stats_copy()
    known = engine.cache.names
    with counters._lock:
        success, errors = Counter(counters.success), Counter(counters.errors)
        prompt, generated, in_flight = (
            Counter(counters.prompt_tokens),
            Counter(counters.generation_tokens),
            set(counters.in_flight),
        )
    when, last = engine.last_step
    running = [n for n in last if n in in_flight]
    waiting = sorted(in_flight - set(running))
    info = (
        f'max_lora="{max_loras}",running_lora_adapters="{label_value(",".join(running))}",'
        f'waiting_lora_adapters="{label_value(",".join(waiting))}"'
    )
    lines = _family("trtpipe_lora_requests_info") + [f"trtpipe_lora_requests_info{{{labels},{info}}} {when:.3f}"]

    def per_adapter(name: str, values: Counter, extra=lambda key: ("", key)) -> list[str]:
        out = _family(name)
        for key in sorted(values, key=str):
            more, lora = extra(key)
            out.append(f'{name}{{{labels},lora_name="{label_value(lora)}"{more}}} {values[key]}')
        return out

    # every served adapter has its counters from the start (0), so rate() sees the first request
    for counter in (errors, prompt, generated, stats.loads, stats.hits, stats.misses):
        for name in known:
            counter.setdefault(name, 0)
    lines += per_adapter(
        "trtpipe_lora_request_success_total",
        success,
        lambda key: (f',finished_reason="{label_value(key[1])}"', key[0]),
    )
    lines += per_adapter("trtpipe_lora_request_error_total", errors)
    lines += per_adapter("trtpipe_lora_prompt_tokens_total", prompt)
    lines += per_adapter("trtpipe_lora_generation_tokens_total", generated)
    lines += per_adapter("trtpipe_lora_cache_loads_total", stats.loads)
    lines += per_adapter("trtpipe_lora_cache_hits_total", stats.hits)
    lines += per_adapter("trtpipe_lora_cache_misses_total", stats.misses)
    lines += per_adapter(
        "trtpipe_lora_cache_evictions_total",
        stats.evictions,
        lambda key: (f',cache="{key[0]}"', key[1]),
    )
    return lines
