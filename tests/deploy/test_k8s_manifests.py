"""`trtpipe deploy k8s` for a one-node recipe (llama70b-fp8: a Deployment) and a two-node one (Llama-3.1-405B
tp8 x pp2: a LeaderWorkerSet): every core object passes kubernetes-validate --strict for Kubernetes 1.30 and
1.34, every custom resource its CRD's published schema (tests/data/crds), and the numbers are the recipe's."""

from __future__ import annotations

import functools
import json
import math
import shutil
import subprocess
import sys

import pytest
import yaml
from deploy_helpers import MULTI_NODE, ONE_NODE, RECIPES, crd_errors, run_cli

from trtpipe.deploy import sources
from trtpipe.deploy.k8s import render
from trtpipe.deploy.layout import layout_of
from trtpipe.deploy.sources import start_terms
from trtpipe.deploy.workload import admin_secret
from trtpipe.app.planning import planned_weight_bytes
from trtpipe.app.validation import load_recipe

kv = pytest.importorskip("kubernetes_validate", reason="pip install 'trtpipe[deploy]'")
pytest.importorskip("jsonschema", reason="pip install 'trtpipe[deploy]'")

VERSIONS = ("1.30.0", "1.34.0")
CUSTOM = {"LeaderWorkerSet", "PodMonitor", "PrometheusRule", "ScaledObject"}


@functools.cache
def _weights(path, overrides: tuple) -> int:
    return planned_weight_bytes(path, list(overrides))


def _render(path, *overrides, autoscaler=None, ready_s=None):
    recipe = load_recipe(path, list(overrides))
    return recipe, render(recipe, _weights(path, overrides), ready_s, autoscaler=autoscaler)


@pytest.fixture(scope="module")
def one():
    return _render(ONE_NODE)


@pytest.fixture(scope="module")
def multi():
    return _render(MULTI_NODE)


def _by_kind(rendered):
    out = {}
    for o in rendered.objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def _pod_templates(lws):
    t = lws["spec"]["leaderWorkerTemplate"]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{lws['metadata']['name']}-{role}"},
            "template": t[f"{role}Template"],
        }
        for role in ("leader", "worker")
    ]


def _validate_all(rendered):
    checked = []
    for obj in rendered.objects:
        if obj["kind"] in CUSTOM:
            assert crd_errors(obj) == [], (obj["kind"], crd_errors(obj)[:5])
            extra = _pod_templates(obj) if obj["kind"] == "LeaderWorkerSet" else []
        else:
            extra = [obj]
        for core in extra:
            for version in VERSIONS:
                kv.validate(core, version, strict=True)
        checked.append(obj["kind"])
    return checked


@pytest.mark.parametrize(
    "path, extra", [(ONE_NODE, []), (MULTI_NODE, []), (ONE_NODE, ["target=llmapi"]), (MULTI_NODE, ["target=llmapi"])]
)
@pytest.mark.parametrize("autoscaler", ["hpa", "keda"])
def test_every_manifest_validates_strictly(path, extra, autoscaler):
    _, r = _render(path, *extra, autoscaler=autoscaler)
    kinds = _validate_all(r)
    assert ("ScaledObject" in kinds) == (autoscaler == "keda") and ("HorizontalPodAutoscaler" in kinds) != (
        autoscaler == "keda"
    )


def test_the_validators_catch_a_typo(one, multi):
    dep = dict(_by_kind(one[1])["Deployment"][0])
    dep["spec"] = {**dep["spec"], "replicaz": 2}
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, "1.30.0", strict=True)
    lws = _by_kind(multi[1])["LeaderWorkerSet"][0]
    bad = {
        **lws,
        "spec": {**lws["spec"], "leaderWorkerTemplate": {**lws["spec"]["leaderWorkerTemplate"], "size": "two"}},
    }
    assert crd_errors(bad)
    pm = _by_kind(one[1])["PodMonitor"][0]
    bad = {**pm, "spec": {**pm["spec"], "podMetricsEndpoints": [{"port": 8002, "path": "/metrics"}]}}
    assert crd_errors(bad)  # port is the container port's name
    typo = {**pm, "spec": {**pm["spec"], "selectr": {}}}
    assert any("selectr" in e for e in crd_errors(typo))


def test_one_node_is_a_deployment_with_four_gpus(one):
    recipe, r = one
    k = _by_kind(r)
    assert "LeaderWorkerSet" not in k and "Role" not in k
    pod = k["Deployment"][0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    budget = r.sources["startup-budget-s"].value
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= budget
    # the planner's FP8 70B at tp4: ~17 GiB per GPU (70.6e9 params, one byte each, plus BF16 embeddings),
    # 4 GPUs read at 1 GB/s (79 s), plus the fixed start costs (337 s), x 1.5
    assert 600 <= budget <= 650, r.sources["startup-budget-s"].source
    assert c["command"][:4] == ["mpirun", "--allow-run-as-root", "-n", "1"] and c["command"].count(":") == 3
    mount = next(m for m in c["volumeMounts"] if m["name"] == "artifacts")
    assert mount["readOnly"] and mount["subPath"] == r.sources["artifact-key"].value
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert k["HorizontalPodAutoscaler"][0]["spec"]["scaleTargetRef"]["kind"] == "Deployment"


@pytest.mark.parametrize("path", [ONE_NODE, MULTI_NODE])
def test_the_admin_key_comes_from_a_secret_and_the_manifests_are_the_same_every_run(path):
    """tritonserver's restricted APIs (shared memory, logging, trace) take their key from a Secret the leader's env
    reads; the manifests name it and hold no key, so two renders are identical (a random key in them was neither)."""
    (recipe, first), again = _render(path), _render(path)[1]
    assert yaml.safe_dump_all(first.objects) == yaml.safe_dump_all(again.objects)
    k = _by_kind(first)
    pod = (
        k["Deployment"][0]["spec"]["template"]["spec"]
        if "Deployment" in k
        else k["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    )
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["TRTPIPE_ADMIN_KEY"]["valueFrom"] == {"secretKeyRef": {"name": admin_secret(recipe), "key": "key"}}
    command = " ".join(c["command"])
    assert "--http-restricted-api=shared-memory,logging,trace:trtpipe-admin-key=$(TRTPIPE_ADMIN_KEY)" in command
    assert "--grpc-restricted-protocol=shared-memory,logging,trace:trtpipe-admin-key=$(TRTPIPE_ADMIN_KEY)" in command


def test_two_nodes_are_one_leaderworkerset_group_of_two_pods(multi):
    recipe, r = multi
    k = _by_kind(r)
    lws = k["LeaderWorkerSet"][0]
    t = lws["spec"]["leaderWorkerTemplate"]
    assert t["size"] == 2
    for role in ("leader", "worker"):
        c = t[f"{role}Template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    leader = t["leaderTemplate"]["spec"]["containers"][0]
    worker = t["workerTemplate"]["spec"]["containers"][0]
    assert "startupProbe" in leader and "ports" in leader and "startupProbe" not in worker and "ports" not in worker
    script = leader["command"][2]
    assert "--host $POD_NAME:8,$POD_NAME-1:8" in script and script.count(" -n 1 ") == 16
    assert script.count("--allow-http=false") == 15  # only rank 0 serves
    assert {o["kind"] for o in r.objects} >= {"ServiceAccount", "Role", "RoleBinding"}
    role = k["Role"][0]
    assert {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]} in role["rules"]
    assert k["Service"][0]["spec"]["selector"]["role"] == "leader"
    assert k["PodMonitor"][0]["spec"]["selector"]["matchLabels"]["role"] == "leader"
    assert k["HorizontalPodAutoscaler"][0]["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert r.sources["startup-budget-s"].value > 800  # 8 GPUs of ~27 GiB each at 1 GB/s + fixed costs, x 1.5


def test_llmapi_serves_trtllm_serve_and_multi_node_runs_its_launcher():
    _, one = _render(ONE_NODE, "target=llmapi")
    c = _by_kind(one)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][0] == "trtllm-serve" and c["startupProbe"]["httpGet"]["path"] == "/health"
    assert [p["name"] for p in c["ports"]] == ["http"]
    assert _by_kind(one)["PodMonitor"][0]["spec"]["podMetricsEndpoints"][0] == {
        "port": "http",
        "path": "/prometheus/metrics",
        "interval": "15s",
    }
    _, multi = _render(MULTI_NODE, "target=llmapi")
    script = _by_kind(multi)["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"][
        "containers"
    ][0]["command"][2]
    assert "-np 16" in script and "trtllm-llmapi-launch trtllm-serve /artifacts/hf" in script


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool")
def test_cli_writes_manifests_that_the_tools_accept(tmp_path):
    out = tmp_path / "k8s"
    result = run_cli("deploy", "k8s", str(MULTI_NODE), "-o", str(out), "--autoscaler", "keda")
    assert result.exit_code == 0, result.stderr
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["namespace"] == "llm" and all((out / f).is_file() for f in kust["resources"])
    core = [str(out / f) for f in kust["resources"] if yaml.safe_load((out / f).read_text())["kind"] not in CUSTOM]
    cli = [sys.executable, "-m", "kubernetes_validate"]  # the kubernetes-validate command
    for version in VERSIONS:
        done = subprocess.run([*cli, "--strict", "-k", version, *core], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    rule = yaml.safe_load(next(out.glob("prometheusrule-*.yaml")).read_text())
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    again = run_cli("deploy", "k8s", str(MULTI_NODE), "-o", str(out))
    assert again.exit_code != 0 and "exists and is not empty" in again.stderr  # nothing overwritten


def test_monitoring_cli_writes_a_config_promtool_accepts(tmp_path):
    result = run_cli("deploy", "monitoring", str(RECIPES / "stories-llmapi-fp8.yaml"), "-o", str(tmp_path / "m"))
    assert result.exit_code == 0, result.stderr
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "config", str(tmp_path / "m" / "prometheus.yml")], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_a_measured_ready_time_replaces_the_fixed_start_cost(tmp_path):
    recipe, r = _render(ONE_NODE)
    estimate = r.sources["startup-budget-s"].value
    load = next(s for name, s, _ in start_terms(recipe, layout_of(recipe), _weights(ONE_NODE, ())) if name == "load")
    _, slow = _render(ONE_NODE, ready_s=500.0)
    expected = math.ceil(1.5 * (500.0 + load))
    assert slow.sources["startup-budget-s"].value == expected > estimate
    assert "measured 500.0 s" in slow.sources["startup-budget-s"].source
    assert sources.PROCESS_START_SOURCE not in slow.sources["startup-budget-s"].source
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"ready_s": 500.0}))
    result = run_cli("deploy", "k8s", str(ONE_NODE), "-o", str(tmp_path / "k"), "--cold-start", str(cold))
    assert result.exit_code == 0, result.stderr
    dep = yaml.safe_load(next((tmp_path / "k").glob("deployment-*.yaml")).read_text())
    probe = dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= expected
    cold.write_text("{}")
    bad = run_cli("deploy", "k8s", str(ONE_NODE), "-o", str(tmp_path / "k2"), "--cold-start", str(cold))
    assert bad.exit_code != 0 and "not a `trtpipe bench cold --json` result" in bad.stderr
    assert not (tmp_path / "k2").exists()


def test_the_cache_is_keyed_by_the_served_artifacts_hashes(tmp_path):
    from trtpipe.deploy.sources import artifact_key
    from trtpipe.pipeline.manifest import write_manifest

    recipe = load_recipe(ONE_NODE, [f"work_dir={tmp_path}"])
    unbuilt = artifact_key(recipe)
    assert "not built yet" in unbuilt.source

    def build(sha: str, build_id: str):
        files = {
            "triton_repo/tensorrt_llm/1/rank0.engine": {"sha256": sha, "size": 1},
            "triton_repo/tensorrt_llm/config.pbtxt": {"sha256": "b" * 64, "size": 1},
        }
        write_manifest(
            tmp_path,
            {
                "format": 1,
                "build_id": build_id,
                "status": "ok",
                "stages": [{"name": "repo", "key": "k", "files": files}],
            },
        )
        return artifact_key(recipe)

    first, same, other = build("a" * 64, "b1"), build("a" * 64, "b2"), build("c" * 64, "b3")
    assert first.value == same.value != other.value != unbuilt.value
    assert "2 file hashes of stage repo in build b3" in other.source


def test_the_startup_budget_counts_every_start_cost_not_only_the_weights():
    """Issue 38 item 10: llama70b-fp8 at tp8 x pp2 (a LeaderWorkerSet of two 8-GPU pods) got 1.5 x the weights'
    read time, 77 s: no process start, engine deserialization, CUDA contexts, KV allocation, warm-up or MPI
    rendezvous. The budget is 1.5 x (each fixed term + the load time), at least the floor, and names each term
    with its source, in the SOURCES.md sentence and the workload's annotation."""
    recipe, r = _render(ONE_NODE, "parallel.tp=8", "parallel.pp=2")
    lws = _by_kind(r)["LeaderWorkerSet"][0]
    budget = r.sources["startup-budget-s"]
    terms = {
        name: (s, src)
        for name, s, src in start_terms(
            recipe, layout_of(recipe), _weights(ONE_NODE, ("parallel.tp=8", "parallel.pp=2"))
        )
    }
    assert set(terms) == {"process", "deserialize", "init", "load"}
    assert terms["init"][0] == sources.INIT_S and terms["process"][0] == sources.PROCESS_START_S
    assert all(s > 0 for s, _ in terms.values())
    assert budget.value == max(sources.FLOOR_S, math.ceil(1.5 * sum(s for s, _ in terms.values())))
    assert budget.value >= sources.FLOOR_S > 77
    for name, (seconds, src) in terms.items():
        assert f"{name} {seconds:.1f} s ({src})" in budget.source
    assert sources.FLOOR_SOURCE in budget.source
    assert lws["metadata"]["annotations"]["trtpipe.dev/startup-budget-s"].startswith(f"{budget.value}: ")
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["startupProbe"]
    assert leader["periodSeconds"] * leader["failureThreshold"] >= budget.value
