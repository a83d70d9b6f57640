"""``trtpipe deploy k8s``: plain manifests and a kustomization for one recipe, written all-or-nothing.

One file per object (kind-name.yaml), ``kustomization.yaml`` listing them under the recipe's namespace, and
``SOURCES.md`` saying where every derived number came from (the same sentences are annotations on the workload).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.deploy import objects, sources, workload
from trtpipe.deploy.layout import Layout, layout_of
from trtpipe.deploy.monitoring import dump_yaml, write_all
from trtpipe.recipe.schema import Recipe

ANNOTATION = "trtpipe.dev/"


@dataclass(frozen=True)
class Rendered:
    objects: list[dict]
    sources: dict[str, sources.Sourced]


@dataclass(frozen=True)
class Derived:
    """The numbers every deployment of a recipe derives (deploy k8s and deploy dynamo alike), with their sources;
    ``notes`` are the same sentences as ``trtpipe.dev/*`` annotations."""

    layout: Layout
    key: sources.Sourced
    budget: sources.Sourced
    shm: sources.Sourced
    cache: sources.Sourced

    @property
    def sources(self) -> dict[str, sources.Sourced]:
        return {"artifact-key": self.key, "startup-budget-s": self.budget, "shm-gib": self.shm, "cache-gib": self.cache}

    @property
    def notes(self) -> dict[str, str]:
        return {f"{ANNOTATION}{k}": f"{v.value}: {v.source}" for k, v in self.sources.items()}


def derive(recipe: Recipe, weight_bytes_per_gpu: int, ready_s: Optional[float] = None) -> Derived:
    layout = layout_of(recipe)
    return Derived(
        layout,
        sources.artifact_key(recipe),
        sources.startup_budget(recipe, layout, weight_bytes_per_gpu, ready_s),
        workload.shm_gib(recipe, layout),
        sources.cache_size_gib(weight_bytes_per_gpu, layout.world),
    )


def render(
    recipe: Recipe, weight_bytes_per_gpu: int, ready_s: Optional[float] = None, autoscaler: Optional[str] = None
) -> Rendered:
    """Every object of the deployment, and the sources of its numbers."""
    d = derive(recipe, weight_bytes_per_gpu, ready_s)
    layout, key, budget, shm, cache, srcs, notes = d.layout, d.key, d.budget, d.shm, d.cache, d.sources, d.notes
    build = workload.leaderworkerset if layout.multinode else workload.deployment
    objs = [build(recipe, layout, key, shm, budget, notes)]
    if layout.multinode:
        objs += workload.rbac(recipe)
    objs += [
        objects.service(recipe, layout),
        objects.pdb(recipe, layout),
        objects.cache_pvc(recipe, cache.value),
        objects.pod_monitor(recipe, layout),
        objects.prometheus_rule(recipe),
        objects.dashboard_configmap(recipe),
    ]
    if (autoscaler or recipe.deploy.autoscaler) == "keda":
        objs.append(objects.scaled_object(recipe, layout))
    else:
        objs += [objects.hpa(recipe, layout), objects.adapter_rules(recipe)]
    return Rendered(objs, srcs)


def file_name(obj: dict) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def sources_md(recipe: Recipe, r: Rendered) -> str:
    lines = [f"# Where the numbers of {recipe.name}'s manifests came from", ""]
    lines += [f"- `{k}` = {v.value}: {v.source}" for k, v in r.sources.items()]
    lines += [
        "",
        "Populate the cache volume before the first rollout: copy the served artifacts (engine target: the "
        "`repo` stage's Triton repository as `triton_repo/`; llmapi: the `export` stage's `hf/` and "
        "`extra_llm_api_options.yaml`) into the directory named by `artifact-key` on the volume.",
        "",
    ]
    if recipe.target == "llmapi" and recipe.lora.adapters:
        lines += [
            f"LoRA adapters ({', '.join(recipe.lora.adapters)}): also copy the `llmapi` stage's `lora/` beside "
            "`hf/`, and use this directory's `extra_llm_api_options.yaml` instead of the export's: its "
            "`lora_config.lora_dir` names the adapters where the pod mounts them.",
            "",
        ]
    return "\n".join(lines)


def write_k8s(
    recipe: Recipe,
    out_dir: Path,
    weight_bytes_per_gpu: int,
    ready_s: Optional[float] = None,
    autoscaler: Optional[str] = None,
    overwrite: bool = False,
) -> Sequence[Path]:
    r = render(recipe, weight_bytes_per_gpu, ready_s, autoscaler)
    files = {file_name(o): dump_yaml(o) for o in r.objects}
    files["kustomization.yaml"] = dump_yaml(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": recipe.deploy.namespace,
            "resources": list(files),
        }
    )
    files["SOURCES.md"] = sources_md(recipe, r)
    if recipe.target == "llmapi" and recipe.lora.adapters:  # lora_config naming the adapters on the volume
        from trtpipe.export.serving import YAML_NAME, llm_api_options, options_yaml

        opts = llm_api_options(recipe, lora_dir=f"{workload.ARTIFACTS}/lora")
        files[YAML_NAME] = options_yaml(opts, recipe.llmapi.version)
    return write_all(out_dir, files, overwrite)
