"""The Grafana dashboard of one recipe: TTFT/ITL p50 and SLO quantile, queue depth, KV use and reuse, tokens/s,
GPU memory (Triton's GPU metrics or DCGM's framebuffer gauge, where present).

Latency panels read the recording rules of :mod:`trtpipe.deploy.alerts` (one definition of each quantile);
the rest read the server's own families from :mod:`trtpipe.deploy.metrics`. The JSON is Grafana's dashboard
model (``schemaVersion`` 39 as the Triton tutorials' ``grafana_inference-metrics_dashboard.json``), with a
``datasource`` variable so it imports into any Grafana with a Prometheus data source.
"""

from __future__ import annotations

from trtpipe.deploy import lora_rules
from trtpipe.deploy.alerts import metrics_of, quantile_name
from trtpipe.deploy.layout import slo_targets
from trtpipe.deploy.metrics import DCGM_FB_USED
from trtpipe.recipe.schema import Recipe

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel_specs(recipe: Recipe, job: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(title, unit, [(PromQL, legend)]) per panel."""
    m, sel = metrics_of(recipe, job)
    targets = slo_targets(recipe)
    out = []
    for metric, title, has in (("ttft", "Time to first token", True), ("itl", "Inter-token latency", m.itl_bucket)):
        if not has:
            continue
        qs = sorted({0.5, targets.get(metric, (0.99, 0))[0]})
        out.append((title, "s", [(f"trtpipe:{metric}_seconds:{quantile_name(q)}", quantile_name(q)) for q in qs]))
    gpu = m.gpu_memory % sel
    out += [
        (
            "Queue depth",
            "short",
            [(f"sum by (job) ({m.waiting % sel})", "waiting"), (f"sum by (job) ({m.running % sel})", "running")],
        ),
        ("Queue time / compute time", "percentunit", [("trtpipe:queue_compute:ratio", "{{pod}}{{instance}}")]),
        ("KV-cache use", "percentunit", [("trtpipe:kv_cache_fraction:max", "{{pod}}{{instance}}")]),
        ("KV-cache reuse", "short", [(m.kv_reuse % sel, "{{pod}}{{instance}}")]),
        ("Output tokens/s", "short", [("trtpipe:output_tokens:rate", "{{job}}")]),
        ("Request error ratio", "percentunit", [("trtpipe:request_error:ratio", "{{job}}")]),
        (
            "GPU memory used",
            "bytes",
            [(gpu, "{{gpu}}{{pod}}")] if DCGM_FB_USED not in gpu else [(gpu, "{{gpu}} {{Hostname}}")],
        ),
    ]
    return out + lora_rules.panel_specs(recipe)


def dashboard(recipe: Recipe, job: str) -> dict:
    panels = []
    for i, (title, unit, exprs) in enumerate(panel_specs(recipe, job)):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(65 + k), "datasource": DATASOURCE, "expr": e, "legendFormat": legend}
                    for k, (e, legend) in enumerate(exprs)
                ],
            }
        )
    return {
        "title": f"trtpipe {recipe.name}",
        "uid": f"trtpipe-{recipe.name}"[:40],
        "schemaVersion": 39,
        "tags": ["trtpipe", recipe.target],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }


def expressions(board: dict) -> list[str]:
    """Every PromQL expression of a dashboard."""
    return [t["expr"] for p in board["panels"] for t in p["targets"]]
