"""``trtpipe deploy dynamo``: an NVIDIA Dynamo graph (DynamoGraphDeployment ``nvidia.com/v1beta1``) for an llmapi
recipe, its engine YAMLs as ConfigMaps, the artifact cache volume, and the same graph as one host's launch script.

Shapes and flags are those of ai-dynamo 1.6.1 (the wheel's ``dynamo/profiler/templates/dgd/trtllm/{agg,disagg}.yaml``
and ``dynamo/trtllm/backend_args.py``): a ``Frontend`` (``type: frontend``, ``python3 -m dynamo.frontend
--router-mode ...``) and TensorRT-LLM workers (``python3 -m dynamo.trtllm``), one ``TRTLLMWorker`` (``type:
worker``) aggregated or ``prefill`` + ``decode`` (``--disaggregation-mode``) disaggregated. Both disaggregated engine
YAMLs hand the KV cache over with ``cache_transceiver_config: {backend: DEFAULT}``, and prefill runs without the
overlap scheduler (ai-dynamo/dynamo@2d8655dd ``examples/backends/trtllm/engine_configs/qwen3/prefill.yaml``).

Everything else is ``deploy k8s``'s: the layout (a worker of tp*pp GPUs is one pod when it fits a node, else
``multinode.nodeCount`` full nodes), the artifact key and the startup budget with their sources, the GPU node
label and tolerations, the read-only artifact volume, ``resources`` and ``/dev/shm`` (here the component's
``sharedMemorySize``, which the operator mounts). Worker probes are on Dynamo's system server (``/health``,
``/live``), set explicitly on the port named ``system``: the operator merges them over its defaults by name.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.deploy import objects, sources, workload
from trtpipe.deploy.k8s import derive, file_name
from trtpipe.deploy.layout import Layout, node_selector
from trtpipe.deploy.monitoring import dump_yaml, write_all
from trtpipe.deploy.trtllm_release import runtime_mismatch
from trtpipe.errors import TrtpipeError
from trtpipe.export.serving import checked, llm_api_options, options_yaml, served_parsers
from trtpipe.recipe.schema import Recipe

DGD_API = "nvidia.com/v1beta1"
IMAGE = "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.6.1"  # the wheel's profiler templates
COMPONENT_TYPES = ("frontend", "worker", "prefill", "decode", "planner", "epp")  # v1beta1 ComponentType enum
CONFIG_DIR = "/etc/trtpipe"
ENGINE_FILE = "engine.yaml"
FRONTEND_PORT = 8000
SYSTEM_PORT = 9090  # the worker's system server (health, metrics), DYN_SYSTEM_PORT
LOCAL_SYSTEM_PORT = 18081  # launch.sh: worker i listens on LOCAL_SYSTEM_PORT + i
ROUTERS = ("kv", "round-robin")  # the Dynamo frontend's --router-mode values trtpipe offers
# component name -> (DGD type, --disaggregation-mode or None)
ROLES = {"TRTLLMWorker": ("worker", None), "prefill": ("prefill", "prefill"), "decode": ("decode", "decode")}
MULTINODE_ENV = [
    {"name": "OMPI_ALLOW_RUN_AS_ROOT", "value": "1"},
    {"name": "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "value": "1"},
]


def roles(disagg: bool) -> tuple[str, ...]:
    return ("prefill", "decode") if disagg else ("TRTLLMWorker",)


def served_name(recipe: Recipe) -> str:
    return recipe.llmapi.served_model_name or recipe.name


def engine_options(recipe: Recipe, role: str) -> dict:
    """The worker's ``--extra-engine-args`` (trtpipe's extra_llm_api_options, plus what its side of a
    disaggregated graph needs)."""
    opts = llm_api_options(recipe)
    if ROLES[role][1]:
        opts["cache_transceiver_config"] = {"backend": "DEFAULT"}
    if ROLES[role][1] == "prefill":
        opts["disable_overlap_scheduler"] = True
    return checked(opts, recipe.llmapi.version)


def worker_args(recipe: Recipe, layout: Layout, role: str, model: str, engine_yaml: str) -> list[str]:
    """Arguments of ``python3 -m dynamo.trtllm`` (flag names of the 1.6.1 wheel's ``backend_args.py``)."""
    p = recipe.parallel
    args = [
        "--model",
        model,
        "--served-model-name",
        served_name(recipe),
        "--extra-engine-args",
        engine_yaml,
        "--publish-kv-events",
        "--kv-block-size",
        str(recipe.engine.kv_cache.tokens_per_block),
        "--tensor-parallel-size",
        str(p.tp),
        "--pipeline-parallel-size",
        str(p.pp),
    ]
    if p.moe_ep > 0:  # as trtllm-serve's line: only an expert-parallel size the recipe sets
        args += ["--expert-parallel-size", str(p.moe_ep)]
    if layout.multinode:
        args += ["--gpus-per-node", str(layout.gpus_per_pod)]
    if ROLES[role][1]:
        args += ["--disaggregation-mode", ROLES[role][1]]
    return args + dynamo_parser_args(recipe)


def dynamo_parser_args(recipe: Recipe) -> list[str]:
    """``--dyn-tool-call-parser`` / ``--dyn-reasoning-parser``: Dynamo 1.6.1's spelling of the deployment's parsers
    (its frontend parses for every backend; trtpipe/models/parsers.py)."""
    flags = {"tool_parser": "--dyn-tool-call-parser", "reasoning_parser": "--dyn-reasoning-parser"}
    args = []
    for kind, parser in served_parsers(recipe).items():
        if parser is not None and parser.dynamo is not None:
            args += [flags[kind], parser.dynamo]
    return args


def frontend_args(router: str) -> list[str]:
    return ["-m", "dynamo.frontend", "--router-mode", router, "--http-port", str(FRONTEND_PORT)]


def config_map_name(recipe: Recipe, role: str) -> str:
    return f"{workload.k8s_name(recipe.name)}-engine-{role.lower()}"


def worker_probes(budget: sources.Sourced) -> dict:
    get = lambda path: {"path": path, "port": "system"}  # noqa: E731
    period = workload.PROBE_PERIOD_S
    return {
        "startupProbe": {
            "httpGet": get("/health"),
            "periodSeconds": period,
            "failureThreshold": max(1, math.ceil(budget.value / period)),
        },
        "readinessProbe": {"httpGet": get("/health"), "periodSeconds": 2, "failureThreshold": 15},
        "livenessProbe": {"httpGet": get("/live"), "periodSeconds": 2, "failureThreshold": 15},
    }


def worker_component(
    recipe: Recipe,
    layout: Layout,
    role: str,
    key: sources.Sourced,
    shm: sources.Sourced,
    budget: sources.Sourced,
    notes: dict,
) -> dict:
    name = workload.k8s_name(recipe.name)
    engine_yaml = f"{CONFIG_DIR}/{ENGINE_FILE}"
    container = {
        "name": "main",
        "image": recipe.deploy.image or IMAGE,
        "workingDir": "/workspace",
        "command": ["python3", "-m", "dynamo.trtllm"],
        "args": worker_args(recipe, layout, role, f"{workload.ARTIFACTS}/hf", engine_yaml),
        "env": [{"name": "DYN_SYSTEM_PORT", "value": str(SYSTEM_PORT)}],
        "ports": [{"name": "system", "containerPort": SYSTEM_PORT}],
        "resources": workload.resources(layout, shm.value),
        "volumeMounts": [
            {"name": "artifacts", "mountPath": workload.ARTIFACTS, "subPath": key.value, "readOnly": True},
            {"name": "engine-config", "mountPath": CONFIG_DIR, "readOnly": True},
        ],
        **worker_probes(budget),
    }
    spec = {
        "containers": [container],
        "volumes": [
            {"name": "artifacts", "persistentVolumeClaim": {"claimName": f"{name}-cache", "readOnly": True}},
            {"name": "engine-config", "configMap": {"name": config_map_name(recipe, role)}},
        ],
        "nodeSelector": node_selector(recipe),
        "tolerations": [dict(t) for t in recipe.deploy.tolerations],
        "terminationGracePeriodSeconds": 30,
    }
    out = {
        "name": role,
        "type": ROLES[role][0],
        "replicas": recipe.deploy.replicas.min,
        "sharedMemorySize": f"{shm.value}Gi",
        "podTemplate": {"metadata": {"labels": workload.labels(recipe), "annotations": dict(notes)}, "spec": spec},
    }
    if layout.multinode:
        out["multinode"] = {"nodeCount": layout.pods}
    return out


def frontend_component(recipe: Recipe, router: str) -> dict:
    container = {
        "name": "main",
        "image": recipe.deploy.image or IMAGE,
        "command": ["python3"],
        "args": frontend_args(router),
        "ports": [{"name": "http", "containerPort": FRONTEND_PORT}],
    }
    return {
        "name": "Frontend",
        "type": "frontend",
        "replicas": 1,
        "podTemplate": {"metadata": {"labels": workload.labels(recipe)}, "spec": {"containers": [container]}},
    }


@dataclass(frozen=True)
class Rendered:
    objects: list[dict]
    engines: dict[str, dict]  # role -> engine options
    sources: dict[str, sources.Sourced]
    layout: Layout
    router: str


def render(
    recipe: Recipe, weight_bytes_per_gpu: int, ready_s: Optional[float] = None, disagg: bool = False, router: str = "kv"
) -> Rendered:
    if recipe.target != "llmapi":
        raise TrtpipeError(
            f"target: {recipe.target}: deploy dynamo serves llmapi recipes (TensorRT-LLM's PyTorch "
            "backend under dynamo.trtllm); use deploy k8s for the Triton repository"
        )
    if router not in ROUTERS:
        raise TrtpipeError(f"--router {router!r}: expected one of {', '.join(ROUTERS)}")
    d = derive(recipe, weight_bytes_per_gpu, ready_s)
    layout, key, budget, shm, cache, srcs, notes = d.layout, d.key, d.budget, d.shm, d.cache, d.sources, d.notes
    engines = {role: engine_options(recipe, role) for role in roles(disagg)}
    spec = {
        "backendFramework": "trtllm",
        "components": [frontend_component(recipe, router)]
        + [worker_component(recipe, layout, r, key, shm, budget, notes) for r in engines],
    }
    if layout.multinode:
        spec["env"] = [dict(e) for e in MULTINODE_ENV]
    name = workload.k8s_name(recipe.name)
    dgd = {
        "apiVersion": DGD_API,
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name, "labels": workload.labels(recipe), "annotations": dict(notes)},
        "spec": spec,
    }
    maps = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map_name(recipe, r), "labels": workload.labels(recipe)},
            "data": {ENGINE_FILE: options_yaml(o, recipe.llmapi.version)},
        }
        for r, o in engines.items()
    ]
    objs = [dgd, *maps, objects.cache_pvc(recipe, cache.value)]
    return Rendered(objs, engines, srcs, layout, router)


# --- one host ----------------------------------------------------------------------------------------------


def local_plan(recipe: Recipe, r: Rendered) -> list[tuple[str, int, str]]:
    """(role, worker index, CUDA_VISIBLE_DEVICES) of every worker launch.sh starts: the graph's replicas while
    their GPUs fit one node (``deploy.gpus_per_node``), else one worker per role."""
    world, gpn = r.layout.world, recipe.deploy.gpus_per_node
    per_role = recipe.deploy.replicas.min
    if per_role * world * len(r.engines) > gpn:
        per_role = 1
    out, gpu = [], 0
    for role in r.engines:
        for _ in range(per_role):
            out.append((role, len(out), ",".join(str(g) for g in range(gpu, gpu + world))))
            gpu += world
    return out


def launch_script(recipe: Recipe, r: Rendered) -> Optional[str]:
    """The graph on one host: file discovery in a fresh directory, every listener Dynamo lets us place on
    127.0.0.1 (its workers' ZMQ event publishers bind all interfaces whatever DYN_EVENT_PLANE_HOST says), the
    frontend first, then the workers with the DGD's flags; None when one worker needs more than one node."""
    if r.layout.multinode or r.layout.world * len(r.engines) > recipe.deploy.gpus_per_node:
        return None
    lines = [
        "#!/usr/bin/env bash",
        f"# {recipe.name} on one host under NVIDIA Dynamo 1.6.1: the graph of dynamographdeployment-*.yaml",
        f"# ({'disaggregated prefill/decode' if len(r.engines) > 1 else 'aggregated'}, --router-mode {r.router}).",
        "# Needs python3 with ai-dynamo[trtllm] and the GPUs listed below; MODEL_DIR: the export stage's hf/.",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "$0")" && pwd)"',
        'MODEL_DIR="${MODEL_DIR:?set MODEL_DIR to the hf/ directory of the export stage}"',
        'HTTP_PORT="${HTTP_PORT:-8000}"',
        'DYN_FILE_KV="$(mktemp -d)"',
        'export DYN_FILE_KV DYN_DISCOVERY_BACKEND=file DYN_HTTP_HOST=127.0.0.1 DYN_HTTP_PORT="$HTTP_PORT"',
        "export DYN_TCP_RPC_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1",
        "export DYN_EVENT_PLANE_HOST=127.0.0.1 HF_HUB_OFFLINE=1",
        "pids=()",
        "stop() {",
        '  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done',
        "  wait || true",
        '  rm -rf "$DYN_FILE_KV"',
        "}",
        "trap stop EXIT",
        "trap 'exit 143' INT TERM",
        f'python3 {shlex.join(frontend_args(r.router)[:-2])} --http-host 127.0.0.1 --http-port "$HTTP_PORT" &',
        'pids+=("$!")',
    ]
    for role, i, gpus in local_plan(recipe, r):
        args = worker_args(recipe, r.layout, role, "@MODEL@", "@ENGINE@")
        line = (
            shlex.join(args)
            .replace("@MODEL@", '"$MODEL_DIR"')
            .replace("@ENGINE@", f'"$HERE/engine-{role.lower()}.yaml"')
        )
        lines += [
            f"CUDA_VISIBLE_DEVICES={gpus} DYN_SYSTEM_PORT={LOCAL_SYSTEM_PORT + i} python3 -m dynamo.trtllm {line} &",
            'pids+=("$!")',
        ]
    lines += [f'echo "OpenAI API: http://127.0.0.1:$HTTP_PORT/v1 (model {served_name(recipe)})"', "wait -n", ""]
    return "\n".join(lines)


def sources_md(recipe: Recipe, r: Rendered, local: bool) -> str:
    lines = [f"# Where the numbers of {recipe.name}'s Dynamo graph came from", ""]
    lines += [f"- `{k}` = {v.value}: {v.source}" for k, v in r.sources.items()]
    lines += [
        f"- `--kv-block-size` = engine.kv_cache.tokens_per_block = {recipe.engine.kv_cache.tokens_per_block}",
        f"- GPUs per worker pod = {r.layout.gpus_per_pod} (tp {recipe.parallel.tp} x pp {recipe.parallel.pp}"
        + (f" over multinode.nodeCount {r.layout.pods}" if r.layout.multinode else "")
        + ")",
        f"- worker replicas = deploy.replicas.min = {recipe.deploy.replicas.min}",
        "",
        "Populate the cache volume before the first rollout: copy the `export` stage's `hf/` into the "
        "directory named by `artifact-key` on the volume (the workers read it as /artifacts/hf).",
        "",
    ]
    if not local:
        lines += ["No launch.sh: one worker needs more GPUs than one node has.", ""]
    return "\n".join(lines)


def write_dynamo(
    recipe: Recipe,
    out_dir: Path,
    weight_bytes_per_gpu: int,
    ready_s: Optional[float] = None,
    disagg: bool = False,
    router: str = "kv",
    overwrite: bool = False,
) -> Sequence[Path]:
    r = render(recipe, weight_bytes_per_gpu, ready_s, disagg, router)
    note = runtime_mismatch(recipe, r.engines.values(), IMAGE)  # raises before anything is written
    files = {file_name(o): dump_yaml(o) for o in r.objects}
    files["kustomization.yaml"] = dump_yaml(
        {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": recipe.deploy.namespace,
            "resources": list(files),
        }
    )
    script = launch_script(recipe, r)
    if script:
        files["launch.sh"] = script
        for role, opts in r.engines.items():
            files[f"engine-{role.lower()}.yaml"] = options_yaml(opts, recipe.llmapi.version)
    files["SOURCES.md"] = sources_md(recipe, r, script is not None) + (f"\n{note}\n" if note else "")
    paths = write_all(out_dir, files, overwrite)
    if script:
        (Path(out_dir) / "launch.sh").chmod(0o755)
    return paths
