"""The serving pods: a Deployment when one pod holds every rank, a LeaderWorkerSet group when the ranks span nodes.

Conventions (triton-inference-server/tutorials@e8489525 ``Deployment/Kubernetes`` charts, kubernetes-sigs/lws
@060ab4da ``docs/examples/tensorrt-llm``): ports ``http`` 8000, ``grpc`` 8001, ``metrics`` 8002 on rank 0 only;
requests == limits with ``nvidia.com/gpu`` = ranks per pod, ``cpu`` = max(4, GPUs), memory 8 GiB per CPU plus
``/dev/shm``; the GPU product as a required node label and the ``nvidia.com/gpu`` taint tolerated; engines mounted
read-only from the artifact cache. A multi-node group's leader waits until every pod of its group runs, then
starts the leader-mode ``mpirun`` over the group's pods (``kubectl exec`` as MPI's remote shell, so the image needs
kubectl, as the LWS example's image has); workers only wait. Only the leader serves, so probes, Service and
monitor select it.
"""

from __future__ import annotations

import math
import shlex

from trtpipe.deploy.layout import Layout, node_selector
from trtpipe.deploy.metrics import BY_TARGET
from trtpipe.deploy.sources import Sourced
from trtpipe.export.serving import serve_command
from trtpipe.recipe.schema import Recipe
from trtpipe.triton.mpi_launch import mpirun_command
from trtpipe.triton.orchestrator import (
    check_placement,
    device_ids,
    gpus_needed,
    needs_orchestrator,
    orchestrator_command,
)
from trtpipe.triton.repo import two_model
from trtpipe.triton.server_process import endpoint_flags, restricted_api_flags
from trtpipe.supervisor import Ports

DEFAULT_IMAGE = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"  # the pins of docs/reference/trtllm-build.md
ARTIFACTS = "/artifacts"
LWS_API = "leaderworkerset.x-k8s.io/v1"
GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
PROBE_PERIOD_S = 10
EXIT_TIMEOUT_S = 25  # below terminationGracePeriodSeconds 30 (tutorials' chart)
KUBESSH = "/opt/trtpipe/kubessh"
PORTS = Ports(http=8000, grpc=8001, metrics=8002)
# tritonserver's shared-memory, logging and trace APIs answer only requests carrying this Secret's key (see
# trtpipe.triton.server_process.RESTRICTED_APIS). The manifests name the Secret, never a key, so they are the same on
# every run and hold nothing secret; Kubernetes puts the key into the command line through $(ADMIN_KEY_ENV).
ADMIN_KEY_ENV = "TRTPIPE_ADMIN_KEY"
ADMIN_SECRET_KEY = "key"


def admin_secret(recipe: Recipe) -> str:
    """The Secret the engine target's rank 0 reads its admin key from (created by the operator: deploy.md)."""
    return f"{k8s_name(recipe.name)}-triton-admin"


def k8s_name(name: str) -> str:
    """A recipe name as a DNS-1035 label (LWS adds '-<group>-<worker>' to pod names, so 45 characters at most)."""
    out = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return (out if out[:1].isalpha() else "m-" + out)[:45].rstrip("-")


def labels(recipe: Recipe) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": k8s_name(recipe.name),
        "app.kubernetes.io/component": "server",
        "app.kubernetes.io/part-of": "trtpipe",
    }


def shm_gib(recipe: Recipe, layout: Layout) -> Sourced:
    """``/dev/shm``: 4 GiB per GPU (NCCL and MPI buffers, the python backend's regions), 16 GiB at least, 64 at
    most (the 16-64 GiB band with an explicit sizeLimit), unless the recipe sets ``deploy.shm_gib``."""
    if recipe.deploy.shm_gib:
        return Sourced(recipe.deploy.shm_gib, "deploy.shm_gib")
    gib = min(64, max(16, 4 * layout.gpus_per_pod))
    return Sourced(gib, f"min(64, max(16, 4 GiB x {layout.gpus_per_pod} GPUs per pod))")


def resources(layout: Layout, shm: int) -> dict:
    cpu = max(4, layout.gpus_per_pod)
    amounts = {
        "nvidia.com/gpu": str(layout.gpus_per_pod),
        "cpu": str(cpu),
        "memory": f"{8 * cpu + shm}Gi",
        "ephemeral-storage": "1Gi",
    }
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _engine_segments(recipe: Recipe, layout: Layout) -> list[str]:
    """The leader-mode mpirun line of the engine target (rank 0 serves, with latency histograms on); for the
    two-model form at tp x pp > 1, upstream's orchestrator mode (trtpipe.triton.orchestrator) on the pod's GPUs."""
    if needs_orchestrator(two_model(recipe), layout.world):
        ids = device_ids(layout.world, layout.world)  # the draft is sharded in the recipe's tp x pp
        check_placement(ids, {m: layout.world for m in ids}, recipe.deploy.gpus_per_node, f"{ARTIFACTS}/triton_repo")
        endpoint = endpoint_flags("0.0.0.0", PORTS) + restricted_api_flags(f"$({ADMIN_KEY_ENV})")
        cmd = orchestrator_command(f"{ARTIFACTS}/triton_repo", gpus_needed(ids), endpoint)
    else:
        cmd = mpirun_command(
            f"{ARTIFACTS}/triton_repo",
            layout.world,
            PORTS,
            bind="0.0.0.0",
            trtllm_models=("tensorrt_llm",),
            admin_key=f"$({ADMIN_KEY_ENV})",  # expanded by Kubernetes from the container's env
        )
    first = next(i for i, a in enumerate(cmd) if a.startswith("--model-repository="))
    rank0 = [
        "--strict-readiness=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        "--metrics-config=histogram_latencies=true",
        "--metrics-interval-ms=1000",
        "--allow-cpu-metrics=false",
        "--allow-gpu-metrics=true",
    ]
    return cmd[: first + 1] + rank0 + cmd[first + 1 :]


def _llmapi_command(recipe: Recipe, layout: Layout) -> list[str]:
    serve = serve_command(recipe, f"{ARTIFACTS}/hf", f"{ARTIFACTS}/extra_llm_api_options.yaml", host="0.0.0.0")
    if not layout.multinode:
        return serve
    # one MPI world over the group's pods under trtllm-llmapi-launch (its multi-node launcher)
    return [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        str(layout.world),
        "--bind-to",
        "none",
        "trtllm-llmapi-launch",
        *serve,
    ]


def serving_command(recipe: Recipe, layout: Layout) -> list[str]:
    cmd = _engine_segments(recipe, layout) if recipe.target == "engine" else _llmapi_command(recipe, layout)
    if not layout.multinode:
        return cmd
    # on the leader: the hosts of the group (its own pod name, then name-1 .. name-(size-1)), kubectl exec as rsh
    hosts = ",".join(
        [f"$POD_NAME:{layout.gpus_per_pod}"] + [f"$POD_NAME-{i}:{layout.gpus_per_pod}" for i in range(1, layout.pods)]
    )
    mpirun, rest = cmd[:2], cmd[2:]
    wait = (
        f'until [ "$(kubectl get pods -l {GROUP_KEY}=$GROUP_KEY --field-selector=status.phase=Running '
        f'--no-headers | wc -l)" -ge {layout.pods} ]; do sleep 2; done'
    )
    line = shlex.join(mpirun) + f" -mca plm_rsh_agent {KUBESSH} --host {hosts} " + shlex.join(rest)
    return ["/bin/sh", "-c", f"{wait}\nexec {line}"]


def probes(recipe: Recipe, budget: Sourced) -> dict:
    """startup (the budget), readiness and liveness (the tutorials' period 2 s x 15 failures) on rank 0's HTTP."""
    ready, live = ("/v2/health/ready", "/v2/health/live") if recipe.target == "engine" else ("/health", "/health")
    get = lambda path: {"path": path, "port": "http"}  # noqa: E731
    return {
        "startupProbe": {
            "httpGet": get(ready),
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(budget.value / PROBE_PERIOD_S)),
        },
        "readinessProbe": {"httpGet": get(ready), "periodSeconds": 2, "failureThreshold": 15},
        "livenessProbe": {"httpGet": get(live), "periodSeconds": 2, "failureThreshold": 15},
    }


def ports(recipe: Recipe) -> list[dict]:
    out = [{"name": "http", "containerPort": PORTS.http}]
    if recipe.target == "engine":
        out += [{"name": "grpc", "containerPort": PORTS.grpc}, {"name": "metrics", "containerPort": PORTS.metrics}]
    return out


def pod_spec(
    recipe: Recipe, layout: Layout, key: Sourced, shm: Sourced, command: list[str], leader: bool, extra: dict
) -> dict:
    """One pod of an instance; ``extra`` holds the leader's ports and probes."""
    name = k8s_name(recipe.name)
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    mounts = [
        {"name": "artifacts", "mountPath": ARTIFACTS, "subPath": key.value, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    volumes = [
        {"name": "artifacts", "persistentVolumeClaim": {"claimName": f"{name}-cache", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm.value}Gi"}},
    ]
    if leader and recipe.target == "engine":
        key_ref = {"secretKeyRef": {"name": admin_secret(recipe), "key": ADMIN_SECRET_KEY}}
        env.append({"name": ADMIN_KEY_ENV, "valueFrom": key_ref})
    if layout.multinode:
        env.append({"name": "GROUP_KEY", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{GROUP_KEY}']"}}})
        if leader:
            mounts.append({"name": "kubessh", "mountPath": "/opt/trtpipe"})
            volumes.append({"name": "kubessh", "configMap": {"name": f"{name}-kubessh", "defaultMode": 0o555}})
    container = {
        "name": "server",
        "image": recipe.deploy.image or DEFAULT_IMAGE,
        "command": command,
        "env": env,
        "resources": resources(layout, shm.value),
        "volumeMounts": mounts,
        **extra,
    }
    spec = {
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": node_selector(recipe),
        "tolerations": [dict(t) for t in recipe.deploy.tolerations],
        "terminationGracePeriodSeconds": 30,
    }
    if layout.multinode:
        spec["serviceAccountName"] = name
    return spec


def leader_extra(recipe: Recipe, budget: Sourced) -> dict:
    return {"ports": ports(recipe), **probes(recipe, budget)}


def deployment(recipe: Recipe, layout: Layout, key: Sourced, shm: Sourced, budget: Sourced, annotations: dict) -> dict:
    name, lab = k8s_name(recipe.name), labels(recipe)
    spec = pod_spec(recipe, layout, key, shm, serving_command(recipe, layout), True, leader_extra(recipe, budget))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": lab, "annotations": annotations},
        "spec": {
            "replicas": recipe.deploy.replicas.min,
            "selector": {"matchLabels": lab},
            "template": {"metadata": {"labels": lab}, "spec": spec},
        },
    }


def leaderworkerset(
    recipe: Recipe, layout: Layout, key: Sourced, shm: Sourced, budget: Sourced, annotations: dict
) -> dict:
    name, lab = k8s_name(recipe.name), labels(recipe)
    lead = pod_spec(recipe, layout, key, shm, serving_command(recipe, layout), True, leader_extra(recipe, budget))
    work = pod_spec(recipe, layout, key, shm, ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep infinity & wait"], False, {})
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "labels": lab, "annotations": annotations},
        "spec": {
            "replicas": recipe.deploy.replicas.min,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": layout.pods,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": {**lab, "role": "leader"}}, "spec": lead},
                "workerTemplate": {"metadata": {"labels": {**lab, "role": "worker"}}, "spec": work},
            },
        },
    }


def rbac(recipe: Recipe) -> list[dict]:
    """What the leader needs: list its group's pods, exec into them (the LWS example's rbac.yaml)."""
    name, lab = k8s_name(recipe.name), labels(recipe)
    meta = {"name": name, "labels": lab}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {"apiGroups": [""], "resources": ["pods", "pods/status"], "verbs": ["get", "list"]},
                {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": recipe.deploy.namespace}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-kubessh", "labels": lab},
            "data": {
                "kubessh": "#!/bin/sh\n# MPI remote shell: run the command in the pod named by the host\n"
                'pod="$1"; shift; exec kubectl exec "$pod" -- /bin/sh -c "$*"\n'
            },
        },
    ]


def metrics_port(recipe: Recipe) -> str:
    """The named container port that serves the metrics path."""
    return "metrics" if BY_TARGET[recipe.target].port == PORTS.metrics else "http"
