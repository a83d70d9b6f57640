"""Helpers shared by the deploy tests (a uniquely named module: tests/ folders have no __init__.py)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from trtpipe.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes"
ONE_NODE = RECIPES / "llama70b-fp8.yaml"
MULTI_NODE = RECIPES / "llama-3.1-405b-fp8-tp8pp2.yaml"
DATA = Path(__file__).resolve().parent.parent / "data"


def run_cli(*args: str):
    """Run `trtpipe ARGS` in-process; return click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


CRDS = DATA / "crds"
CRD_FILES = {  # (apiVersion, kind) -> schema file (tests/data/crds/SOURCES.md)
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets_v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors_v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules_v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects_v1alpha1.json",
    # derived from the operator's Go types, not extracted from the CRD (SOURCES.md says how)
    ("nvidia.com/v1beta1", "DynamoGraphDeployment"): "nvidia.com_dynamographdeployments_v1beta1.json",
}


def closed(schema):
    """The schema with ``additionalProperties: false`` on every object that lists properties and does not keep
    unknown fields: CRD schemas leave it out because the API server prunes, so a typo would pass otherwise."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def crd_errors(obj: dict) -> list[str]:
    """jsonschema errors of a custom resource against its CRD's published schema (closed as above)."""
    import json

    import jsonschema

    schema = closed(json.loads((CRDS / CRD_FILES[(obj["apiVersion"], obj["kind"])]).read_text()))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]
