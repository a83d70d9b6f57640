"""Deployment beyond one host: Kubernetes manifests and Prometheus/Grafana monitoring from a recipe.

Data flows recipe -> :mod:`layout` (pods, GPUs, node selection) -> :mod:`workload` / :mod:`objects` (manifest
dicts) -> :mod:`k8s` (files + kustomization); :mod:`alerts`, :mod:`dashboard` and :mod:`monitoring` write the same
rules and dashboard for servers run by hand. :mod:`metrics` is the one table of metric names per server.
"""
