"""The objects around the serving pods: Service, PodDisruptionBudget, PodMonitor, the autoscaler (HPA on a
prometheus-adapter metric, or a KEDA ScaledObject), PrometheusRule, the Grafana dashboard ConfigMap, the cache PVC.

Shapes follow triton-inference-server/tutorials@e8489525 ``Deployment/Kubernetes`` (``service.yaml``,
``pod-monitor.yaml``, ``horizontal-pod-autoscaler.yaml``), prometheus-operator@6adcebc5 CRDs (PodMonitor ``port``
is the container port's *name*; ``jobLabel`` makes the job the pod's ``app.kubernetes.io/name``, which the rules
select), kedacore/keda@8b4f083c ``pkg/scalers/prometheus_scaler.go`` (metadata values are strings) and
triton-inference-server/server@0687d71d ``deploy/k8s-onprem/values.yaml`` (the prometheus-adapter rule shape).
"""

from __future__ import annotations

import json

from trtpipe.deploy.alerts import Timing, rule_file
from trtpipe.deploy.dashboard import dashboard
from trtpipe.deploy.layout import Layout
from trtpipe.deploy.metrics import BY_TARGET
from trtpipe.deploy.workload import LWS_API, PORTS, k8s_name, labels, metrics_port
from trtpipe.recipe.schema import Recipe

JOB_LABEL = "app.kubernetes.io/name"
# the autoscaler's metric: recording rule, its adapter name, the per-pod target value
SCALE_METRICS = {
    "queue": ("trtpipe:queue_compute:ratio", "trtpipe_queue_compute_ratio"),
    "kv_cache": ("trtpipe:kv_cache_fraction:max", "trtpipe_kv_cache_fraction"),
}


def serving_selector(recipe: Recipe, layout: Layout) -> dict[str, str]:
    """Pods that serve: every pod of a Deployment, only leaders of a LeaderWorkerSet."""
    return {**labels(recipe), **({"role": "leader"} if layout.multinode else {})}


def scale_target(recipe: Recipe, layout: Layout) -> dict:
    kind = ("LeaderWorkerSet", LWS_API) if layout.multinode else ("Deployment", "apps/v1")
    return {"apiVersion": kind[1], "kind": kind[0], "name": k8s_name(recipe.name)}


def scale_threshold(recipe: Recipe) -> float:
    """Queue time equal to compute time (the tutorials' 1000m), or KV use 0.1 below the alert."""
    return 1.0 if recipe.deploy.scale_on == "queue" else round(max(0.05, recipe.deploy.kv_cache_alert - 0.1), 3)


def service(recipe: Recipe, layout: Layout) -> dict:
    ports = [{"name": "http", "port": PORTS.http, "targetPort": "http"}]
    if recipe.target == "engine":
        ports += [
            {"name": "grpc", "port": PORTS.grpc, "targetPort": "grpc"},
            {"name": "metrics", "port": PORTS.metrics, "targetPort": "metrics"},
        ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": k8s_name(recipe.name), "labels": labels(recipe)},
        "spec": {"type": "ClusterIP", "selector": serving_selector(recipe, layout), "ports": ports},
    }


def pdb(recipe: Recipe, layout: Layout) -> dict:
    """One instance down at a time (a LWS group restarts as a whole when any of its pods goes)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": k8s_name(recipe.name), "labels": labels(recipe)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": serving_selector(recipe, layout)}},
    }


def pod_monitor(recipe: Recipe, layout: Layout) -> dict:
    d = recipe.deploy
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": k8s_name(recipe.name), "labels": {**labels(recipe), **d.monitor_labels}},
        "spec": {
            "jobLabel": JOB_LABEL,
            "selector": {"matchLabels": serving_selector(recipe, layout)},
            "podMetricsEndpoints": [
                {
                    "port": metrics_port(recipe),
                    "path": BY_TARGET[recipe.target].path,
                    "interval": f"{d.scrape_interval_s}s",
                }
            ],
        },
    }


def prometheus_rule(recipe: Recipe) -> dict:
    t = Timing(interval=f"{recipe.deploy.scrape_interval_s}s")
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": k8s_name(recipe.name), "labels": {**labels(recipe), **recipe.deploy.monitor_labels}},
        "spec": rule_file(recipe, k8s_name(recipe.name), t),
    }


def dashboard_configmap(recipe: Recipe) -> dict:
    """For Grafana's dashboard sidecar (kube-prometheus-stack watches ConfigMaps labelled grafana_dashboard)."""
    name = k8s_name(recipe.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-dashboard", "labels": {**labels(recipe), "grafana_dashboard": "1"}},
        "data": {f"{name}.json": json.dumps(dashboard(recipe, name), indent=1)},
    }


def hpa(recipe: Recipe, layout: Layout) -> dict:
    r = recipe.deploy.replicas
    metric = SCALE_METRICS[recipe.deploy.scale_on][1]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": k8s_name(recipe.name), "labels": labels(recipe)},
        "spec": {
            "scaleTargetRef": scale_target(recipe, layout),
            "minReplicas": r.min,
            "maxReplicas": r.max,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": f"{int(scale_threshold(recipe) * 1000)}m"},
                    },
                }
            ],
        },
    }


def adapter_rules(recipe: Recipe) -> dict:
    """prometheus-adapter ``rules.custom``: the recording rule per pod as a custom metric (a ConfigMap to merge into
    the adapter's config, e.g. helm ``--set-file rules.custom=...``)."""
    series, name = SCALE_METRICS[recipe.deploy.scale_on]
    rule = {
        "seriesQuery": f'{series}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{series}$", "as": name},
        "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{k8s_name(recipe.name)}-adapter-rules", "labels": labels(recipe)},
        "data": {"rules.yaml": json.dumps({"rules": [rule]}, indent=1)},
    }


def scaled_object(recipe: Recipe, layout: Layout) -> dict:
    d = recipe.deploy
    series = SCALE_METRICS[d.scale_on][0]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": k8s_name(recipe.name), "labels": labels(recipe)},
        "spec": {
            "scaleTargetRef": scale_target(recipe, layout),
            "minReplicaCount": d.replicas.min,
            "maxReplicaCount": d.replicas.max,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": d.prometheus_url,
                        "query": f'max({series}{{job="{k8s_name(recipe.name)}",namespace="{d.namespace}"}})',
                        "threshold": f"{scale_threshold(recipe):g}",
                    },
                }
            ],
        },
    }


def cache_pvc(recipe: Recipe, size_gib: int) -> dict:
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": f"{size_gib}Gi"}}}
    if recipe.deploy.storage_class:
        spec["storageClassName"] = recipe.deploy.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": f"{k8s_name(recipe.name)}-cache", "labels": labels(recipe)},
        "spec": spec,
    }
