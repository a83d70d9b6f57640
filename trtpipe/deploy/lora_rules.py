"""The monitoring of a recipe that serves LoRA adapters, split by adapter: recording rules, one alert and the
dashboard panels over the ``trtpipe_lora_*`` families (:mod:`trtpipe.serving.lora_metrics`).

Only the OpenAI twin writes those families: trtllm-serve exports no per-adapter metric
(``tensorrt_llm/metrics/collector.py@050f80de`` lists none) and the engine target does not serve LoRA yet. Against
trtllm-serve itself the recording rules stay empty and the alert silent; the panels say so by showing no series.

- ``trtpipe:lora_requests:rate`` and ``trtpipe:lora_output_tokens:rate``: finished requests and generated tokens
  per second, ``by (job, lora_name)``; the base model's share is the job's total minus their sum.
- ``trtpipe:lora_cache_miss:ratio``: the share of an adapter's steps that had to activate it into the device cache
  (``max_loras`` slots). Above ``deploy.lora_cache_miss_alert`` for ``slo_for`` the adapter cache thrashes:
  ``LoraAdapterCacheThrashing`` warns, naming the adapter.
- ``trtpipe:lora_cache_loads:rate``: reads from the adapter's directory (the host cache, ``max_cpu_loras``, missed).
"""

from __future__ import annotations

from trtpipe.deploy.metrics import LORA
from trtpipe.recipe.schema import Recipe

BY = "job, lora_name"


def serves_lora(recipe: Recipe) -> bool:
    return recipe.target == "llmapi" and bool(recipe.lora.adapters)


def _rate(name: str, job: str, window: str) -> str:
    return f'sum by ({BY}) (rate({name}{{job="{job}"}}[{window}]))'


def recording_rules(recipe: Recipe, job: str, t) -> list[dict]:
    if not serves_lora(recipe):
        return []
    hits, misses = _rate(LORA["cache_hits"], job, t.rate), _rate(LORA["cache_misses"], job, t.rate)
    return [
        {"record": "trtpipe:lora_requests:rate", "expr": _rate(LORA["requests"], job, t.short_rate)},
        {"record": "trtpipe:lora_output_tokens:rate", "expr": _rate(LORA["output_tokens"], job, t.short_rate)},
        {"record": "trtpipe:lora_cache_miss:ratio", "expr": f"{misses} / clamp_min({hits} + {misses}, 1e-9)"},
        {"record": "trtpipe:lora_cache_loads:rate", "expr": _rate(LORA["cache_loads"], job, t.short_rate)},
    ]


def alert_rules(recipe: Recipe, t) -> list[dict]:
    if not serves_lora(recipe):
        return []
    bound = recipe.deploy.lora_cache_miss_alert
    return [
        {
            "alert": "LoraAdapterCacheThrashing",
            "expr": f"trtpipe:lora_cache_miss:ratio > {bound:g}",
            "for": t.slo_for,
            "labels": {"recipe": recipe.name, "severity": "warning"},
            "annotations": {
                "summary": f"adapter {{{{ $labels.lora_name }}}} is activated into the device cache on "
                f"{{{{ $value | humanizePercentage }}}} of its steps (over {bound:g}): raise lora.max_loras "
                f"({recipe.lora.max_loras}) or route its requests together ({{{{ $labels.job }}}})"
            },
        }
    ]


def panel_specs(recipe: Recipe) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(PromQL, legend)]) of the per-adapter panels."""
    if not serves_lora(recipe):
        return []
    base = "trtpipe:output_tokens:rate - on (job) sum by (job) (trtpipe:lora_output_tokens:rate)"
    return [
        (
            "Output tokens/s by adapter",
            "short",
            [("trtpipe:lora_output_tokens:rate", "{{lora_name}}"), (base, "base model")],
        ),
        ("Requests/s by adapter", "reqps", [("trtpipe:lora_requests:rate", "{{lora_name}}")]),
        ("Adapter device-cache miss ratio", "percentunit", [("trtpipe:lora_cache_miss:ratio", "{{lora_name}}")]),
        ("Adapter reads from disk/s", "short", [("trtpipe:lora_cache_loads:rate", "{{lora_name}}")]),
    ]
