"""Prometheus recording rules and SLO alerts of one recipe, as the plain rule-file dict (``{"groups": [...]}``).

Recording rules first, alerts on them: every threshold comes from the recipe (``deploy.slo``,
``deploy.kv_cache_alert``, ``deploy.max_error_ratio``, ``deploy.acceptance_drift_alert``: :mod:`trtpipe.deploy.acceptance`), every metric name from :mod:`trtpipe.deploy.metrics`.
The queue/compute ratio is the Triton tutorials' ``triton:queue_compute:ratio`` (triton-inference-server/tutorials
@e8489525 ``Deployment/Kubernetes/TensorRT-LLM_Autoscaling_and_Load_Balancing/triton-metrics_prometheus-rule.yaml``);
for trtllm-serve compute time is end-to-end minus queue time. Series keep ``namespace``/``pod`` (Kubernetes) or
``instance`` so prometheus-adapter can hand them to an HPA per pod. Windows and ``for`` durations are a
:class:`Timing` (the defaults page after minutes; the end-to-end test uses seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from trtpipe.deploy import acceptance, lora_rules
from trtpipe.deploy.layout import slo_targets
from trtpipe.deploy.metrics import BY_TARGET, ServerMetrics, selectors
from trtpipe.recipe.schema import Recipe

PER_TARGET = "job, namespace, pod, instance"  # labels the per-pod series keep (absent ones are dropped)


@dataclass(frozen=True)
class Timing:
    interval: str = "15s"  # rule evaluation
    rate: str = "5m"  # latency quantiles and error ratios
    short_rate: str = "1m"  # queue/compute ratio, throughput
    slo_for: str = "5m"
    kv_for: str = "2m"
    down_for: str = "1m"
    drift_baseline: str = "6h"  # speculative acceptance: the window its short-term rate is compared with


def quantile_name(q: float) -> str:
    """0.99 -> 'p99', 0.999 -> 'p99_9' (recording-rule names allow no dots)."""
    return "p" + f"{q * 100:g}".replace(".", "_")


def client_model(recipe: Recipe) -> str:
    """The Triton model clients call (its TTFT and failures are what users see)."""
    return "tensorrt_llm_bls" if recipe.triton.bls else recipe.triton.model_name


def metrics_of(recipe: Recipe, job: str) -> tuple[ServerMetrics, dict[str, str]]:
    return BY_TARGET[recipe.target], selectors(job, client_model(recipe))


def _quantile(bucket: str, q: float, scale: float, window: str) -> str:
    expr = f"histogram_quantile({q:g}, sum by (le, job) (rate({bucket}[{window}])))"
    return expr if scale == 1.0 else f"{expr} * {scale:g}"


def recording_rules(recipe: Recipe, job: str, t: Timing) -> list[dict]:
    m, sel = metrics_of(recipe, job)
    rules = []
    targets = slo_targets(recipe)
    for metric, bucket in (("ttft", m.ttft_bucket), ("itl", m.itl_bucket)):
        if bucket is None:
            continue
        qs = sorted({0.5, targets.get(metric, (0.99, 0))[0]})
        for q in qs:
            rules.append(
                {
                    "record": f"trtpipe:{metric}_seconds:{quantile_name(q)}",
                    "expr": _quantile(bucket % sel, q, m.ttft_scale if metric == "ttft" else 1.0, t.rate),
                }
            )
    queue, compute = (
        f"rate({m.queue_seconds % sel}[{t.short_rate}])",
        f"rate({m.compute_seconds % sel}[{t.short_rate}])",
    )
    if m.server == "trtllm-serve":  # e2e includes the queue: compute = e2e - queue
        ratio = f"{queue} / clamp_min({compute} - {queue}, 1e-6)"
    else:  # both in µs; 1 µs floor as the tutorials' rule
        ratio = f"{queue} / clamp_min({compute}, 1)"
    fail, ok = f"rate({m.failure % sel}[{t.rate}])", f"rate({m.success % sel}[{t.rate}])"
    rules += [
        {"record": "trtpipe:queue_compute:ratio", "expr": f"max by ({PER_TARGET}) ({ratio})"},
        # averaged over the short window: the gauge swings by a request's blocks from one step to the next
        {
            "record": "trtpipe:kv_cache_fraction:max",
            "expr": f"max by ({PER_TARGET}) (avg_over_time({m.kv_fraction % sel}[{t.short_rate}]))",
        },
        {"record": "trtpipe:waiting_requests:max", "expr": f"max by ({PER_TARGET}) ({m.waiting % sel})"},
        {
            "record": "trtpipe:request_error:ratio",
            "expr": f"sum by (job) ({fail}) / clamp_min(sum by (job) ({ok}) + sum by (job) ({fail}), 1e-9)",
        },
        {
            "record": "trtpipe:output_tokens:rate",
            "expr": f"sum by (job) (rate({m.output_tokens % sel}[{t.short_rate}]))",
        },
    ]
    if acceptance.applies(recipe, m):
        rules += acceptance.recording_rules(m, sel, t.rate, t.drift_baseline)
    return rules + lora_rules.recording_rules(recipe, job, t)


def alert_rules(recipe: Recipe, job: str, t: Timing) -> list[dict]:
    m, _ = metrics_of(recipe, job)
    d, targets = recipe.deploy, slo_targets(recipe)
    labels = {"recipe": recipe.name}
    alerts = []
    for metric, title in (("ttft", "TTFT"), ("itl", "ITL")):
        if metric not in targets or (metric == "itl" and m.itl_bucket is None):
            continue
        q, bound = targets[metric]
        alerts.append(
            {
                "alert": f"{title}AboveSLO",
                "expr": f"trtpipe:{metric}_seconds:{quantile_name(q)} > {bound:g}",
                "for": t.slo_for,
                "labels": {**labels, "severity": "page"},
                "annotations": {
                    "summary": f"{title} p{q * 100:g} {{{{ $value | humanizeDuration }}}} over the SLO {bound:g}s "
                    f"({{{{ $labels.job }}}})"
                },
            }
        )
    alerts += [
        {
            "alert": "QueueTimeOverComputeTime",
            "expr": "trtpipe:queue_compute:ratio > 1",
            "for": t.slo_for,
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": "requests wait longer than they compute ({{ $labels.pod }}{{ $labels.instance }}): "
                "add replicas"
            },
        },
        {
            "alert": "KVCacheNearlyFull",
            "expr": f"trtpipe:kv_cache_fraction:max > {d.kv_cache_alert:g}",
            "for": t.kv_for,
            "labels": {**labels, "severity": "warning"},
            "annotations": {
                "summary": f"KV-cache blocks {{{{ $value | humanizePercentage }}}} used (over {d.kv_cache_alert:g}) "
                "({{ $labels.pod }}{{ $labels.instance }})"
            },
        },
        {
            "alert": "RequestErrors",
            "expr": f"trtpipe:request_error:ratio > {d.max_error_ratio:g}",
            "for": t.slo_for,
            "labels": {**labels, "severity": "page"},
            "annotations": {
                "summary": f"{{{{ $value | humanizePercentage }}}} of requests fail (over {d.max_error_ratio:g})"
            },
        },
        {
            "alert": "TargetDown",
            "expr": f'up{{job="{job}"}} == 0 or absent(up{{job="{job}"}})',
            "for": t.down_for,
            "labels": {**labels, "severity": "page"},
            "annotations": {"summary": f"{m.server} of {recipe.name} is not scraped ({{{{ $labels.instance }}}})"},
        },
    ]
    if acceptance.applies(recipe, m):
        alerts.append(acceptance.alert_rule(recipe, t.drift_baseline, t.slo_for))
    return alerts + lora_rules.alert_rules(recipe, t)


def rule_file(recipe: Recipe, job: str, t: Timing = Timing()) -> dict:
    """The rule file (``promtool check rules`` input; a PrometheusRule's ``spec``)."""
    return {
        "groups": [
            {"name": f"{recipe.name}.recording", "interval": t.interval, "rules": recording_rules(recipe, job, t)},
            {"name": f"{recipe.name}.slo", "interval": t.interval, "rules": alert_rules(recipe, job, t)},
        ]
    }
