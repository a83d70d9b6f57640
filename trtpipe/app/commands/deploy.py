"""``trtpipe deploy``: Kubernetes manifests (``k8s``), Dynamo graphs (``dynamo``), monitoring (``monitoring``)."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.group()
def deploy() -> None:
    """Deploy beyond one host: Kubernetes manifests (k8s) and Prometheus/Grafana monitoring (monitoring)."""


@deploy.command(name="monitoring")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option("--target", "targets", multiple=True, help="HOST:PORT to scrape (repeatable; default: the recipe's).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_monitoring(recipe: Path, overrides, out: Path, targets, overwrite: bool) -> None:
    """Prometheus scrape config, rule file (recording rules, SLO alerts) and Grafana dashboard for RECIPE."""
    from trtpipe.deploy.monitoring import write_monitoring
    from trtpipe.app.validation import load_recipe

    for path in write_monitoring(load_recipe(recipe, overrides), out, targets or None, overwrite=overwrite):
        click.echo(path)


@deploy.command(name="k8s")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option(
    "--autoscaler",
    type=click.Choice(["hpa", "keda"]),
    default=None,
    help="HPA + prometheus-adapter rules, or a KEDA ScaledObject (default: the recipe's deploy.autoscaler).",
)
@click.option(
    "--cold-start",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A `trtpipe bench cold --json` result: its measured ready time also bounds the startup probe.",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_k8s(recipe: Path, overrides, out: Path, autoscaler, cold_start, overwrite: bool) -> None:
    """Kubernetes manifests + kustomization for RECIPE (Deployment, or LeaderWorkerSet across nodes)."""
    from trtpipe.deploy.k8s import write_k8s
    from trtpipe.app.planning import planned_weight_bytes
    from trtpipe.deploy.sources import measured_ready_s
    from trtpipe.app.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    weights = planned_weight_bytes(recipe, overrides)
    for path in write_k8s(loaded, out, weights, measured_ready_s(cold_start), autoscaler, overwrite):
        click.echo(path)


@deploy.command(name="dynamo")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option("--disagg", is_flag=True, help="Separate prefill and decode workers (KV handed over between them).")
@click.option(
    "--router",
    type=click.Choice(["kv", "round-robin"]),
    default="kv",
    show_default=True,
    help="The frontend's --router-mode.",
)
@click.option(
    "--cold-start",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A `trtpipe bench cold --json` result: its measured ready time also bounds the startup probe.",
)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_dynamo(recipe: Path, overrides, out: Path, disagg: bool, router: str, cold_start, overwrite: bool) -> None:
    """NVIDIA Dynamo DynamoGraphDeployment + engine ConfigMaps for an llmapi RECIPE, and launch.sh for one host."""
    from trtpipe.deploy.dynamo import write_dynamo
    from trtpipe.app.planning import planned_weight_bytes
    from trtpipe.deploy.sources import measured_ready_s
    from trtpipe.app.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    if loaded.target != "llmapi":
        raise click.UsageError(
            f"{recipe}: target: {loaded.target}; deploy dynamo serves target: llmapi recipes "
            "(use deploy k8s for the Triton repository)"
        )
    from trtpipe.export.lora import dynamo_refusal

    if dynamo_refusal(loaded):
        raise click.UsageError(f"{recipe}: {dynamo_refusal(loaded)}")
    weights = planned_weight_bytes(recipe, overrides)
    for path in write_dynamo(loaded, out, weights, measured_ready_s(cold_start), disagg, router, overwrite):
        click.echo(path)
    from trtpipe.deploy.dynamo import IMAGE
    from trtpipe.deploy.trtllm_release import runtime_mismatch

    note = runtime_mismatch(loaded, (), IMAGE)  # the engine YAMLs were checked by write_dynamo
    if note:
        click.echo(note, err=True)
