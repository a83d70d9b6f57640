"""`trtpipe deploy dynamo` for stories-llmapi-fp8 and Llama-3.1-70B (llmapi), aggregated and disaggregated, and a
two-node 405B: the DynamoGraphDeployment passes the strict v1beta1 schema derived from the operator's Go types
(tests/data/crds/SOURCES.md), its pod templates kubernetes-validate --strict as v1 PodTemplates (1.30, 1.34), the
ConfigMaps and PVC as core objects; the worker flags are ones the installed ai-dynamo 1.6.1 wheel's dynamo.trtllm
defines, --kv-block-size is the engine YAML's tokens_per_block, both disaggregated YAMLs hand the KV cache over,
and launch.sh starts the same workers with the same flags (shellcheck-clean)."""

from __future__ import annotations

import functools
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from deploy_helpers import MULTI_NODE, RECIPES, crd_errors, run_cli

from trtpipe.deploy.dynamo import COMPONENT_TYPES, render
from trtpipe.app.planning import planned_weight_bytes
from trtpipe.app.validation import load_recipe

kv = pytest.importorskip("kubernetes_validate", reason="pip install 'trtpipe[deploy]'")
pytest.importorskip("jsonschema", reason="pip install 'trtpipe[deploy]'")

VERSIONS = ("1.30.0", "1.34.0")
STORIES = RECIPES / "stories-llmapi-fp8.yaml"
LLAMA70 = RECIPES / "llama-3.1-70b-fp8-llmapi.yaml"
CASES = [(STORIES, False), (STORIES, True), (LLAMA70, False), (LLAMA70, True)]


@functools.cache
def _rendered(path, disagg: bool, router: str = "kv", overrides: tuple = ()):
    recipe = load_recipe(path, list(overrides))
    return recipe, render(recipe, planned_weight_bytes(path, list(overrides)), None, disagg, router)


def _dgd(r):
    return next(o for o in r.objects if o["kind"] == "DynamoGraphDeployment")


def _workers(r):
    return [c for c in _dgd(r)["spec"]["components"] if c["type"] != "frontend"]


def _engine_yaml(r, component):
    """The engine YAML a component's worker reads: its ConfigMap, found through the pod's volume."""
    spec = component["podTemplate"]["spec"]
    cm = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    obj = next(o for o in r.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == cm)
    return yaml.safe_load(obj["data"]["engine.yaml"])


def _flag(args, name):
    return args[args.index(name) + 1]


def _pod_template(component):
    return {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": component["name"].lower()},
        "template": component["podTemplate"],
    }


def _check_graph(dgd):
    assert crd_errors(dgd) == [], crd_errors(dgd)[:5]
    comps = dgd["spec"]["components"]
    assert {c["type"] for c in comps} <= set(COMPONENT_TYPES)
    names = [c["name"].lower() for c in comps]
    assert len(names) == len(set(names))  # the CRD's CEL rule: unique case-insensitively
    assert sum(c["type"] == "epp" for c in comps) <= 1
    for c in comps:
        for version in VERSIONS:
            kv.validate(_pod_template(c), version, strict=True)


@pytest.mark.parametrize("path, disagg", CASES, ids=lambda v: getattr(v, "stem", str(v)))
def test_every_object_validates_strictly(path, disagg):
    _, r = _rendered(path, disagg)
    _check_graph(_dgd(r))
    core = [o for o in r.objects if o["kind"] != "DynamoGraphDeployment"]
    assert sorted(o["kind"] for o in core) == ["ConfigMap"] * (2 if disagg else 1) + ["PersistentVolumeClaim"]
    for obj in core:
        for version in VERSIONS:
            kv.validate(obj, version, strict=True)


@pytest.mark.parametrize("path, disagg", CASES, ids=lambda v: getattr(v, "stem", str(v)))
def test_workers_carry_the_recipe(path, disagg):
    recipe, r = _rendered(path, disagg)
    front, *workers = _dgd(r)["spec"]["components"]
    assert (
        front["type"] == "frontend"
        and _flag(front["podTemplate"]["spec"]["containers"][0]["args"], "--router-mode") == "kv"
    )
    assert [(w["name"], w["type"]) for w in workers] == (
        [("prefill", "prefill"), ("decode", "decode")] if disagg else [("TRTLLMWorker", "worker")]
    )
    world = recipe.parallel.tp * recipe.parallel.pp
    for w in workers:
        c = w["podTemplate"]["spec"]["containers"][0]
        args = c["args"]
        assert c["command"] == ["python3", "-m", "dynamo.trtllm"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(world) == c["resources"]["requests"]["nvidia.com/gpu"]
        assert w["replicas"] == recipe.deploy.replicas.min and "multinode" not in w
        assert _flag(args, "--model") == "/artifacts/hf" and "--publish-kv-events" in args
        assert _flag(args, "--served-model-name") == (recipe.llmapi.served_model_name or recipe.name)
        assert _flag(args, "--tensor-parallel-size") == str(recipe.parallel.tp)
        engine = _engine_yaml(r, w)
        assert (
            int(_flag(args, "--kv-block-size"))
            == engine["kv_cache_config"]["tokens_per_block"]
            == recipe.engine.kv_cache.tokens_per_block
        )
        assert _flag(args, "--extra-engine-args") == "/etc/trtpipe/engine.yaml"
        mount = next(m for m in c["volumeMounts"] if m["name"] == "artifacts")
        assert mount["readOnly"] and mount["subPath"] == r.sources["artifact-key"].value
        probe = c["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= r.sources["startup-budget-s"].value
        assert w["podTemplate"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        role = w["name"] if disagg else None
        assert (_flag(args, "--disaggregation-mode") if role else None) == role
        assert ("cache_transceiver_config" in engine) == disagg
        if disagg:
            assert engine["cache_transceiver_config"] == {"backend": "DEFAULT"}
        assert engine.get("disable_overlap_scheduler", False) == (role == "prefill")


def test_the_70b_graph_is_four_gpus_per_worker_and_two_replicas():
    _, r = _rendered(LLAMA70, True)
    assert [
        (w["name"], w["replicas"], w["podTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for w in _workers(r)
    ] == [("prefill", 2, "4"), ("decode", 2, "4")]
    # the planner's FP8 70B at tp4 (~18.4 GiB per GPU) read at deploy.storage_read_gbs 2 GB/s (39.5 s) plus the
    # fixed start costs (337 s), x 1.5 = 566 s: the 600 s floor
    assert r.sources["startup-budget-s"].value == 600, r.sources["startup-budget-s"].source


def test_a_worker_larger_than_a_node_is_multinode():
    recipe, r = _rendered(MULTI_NODE, False, "round-robin", ("target=llmapi",))
    dgd = _dgd(r)
    _check_graph(dgd)
    (w,) = _workers(r)
    assert w["multinode"] == {"nodeCount": 2}  # tp8 x pp2 over 8-GPU nodes
    args = w["podTemplate"]["spec"]["containers"][0]["args"]
    assert w["podTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert _flag(args, "--gpus-per-node") == "8" and _flag(args, "--pipeline-parallel-size") == "2"
    assert {e["name"] for e in dgd["spec"]["env"]} == {"OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"}
    assert (
        _flag(dgd["spec"]["components"][0]["podTemplate"]["spec"]["containers"][0]["args"], "--router-mode")
        == "round-robin"
    )


def test_the_schema_catches_a_typo():
    _, r = _rendered(STORIES, True)
    dgd = _dgd(r)
    front, pre, dec = dgd["spec"]["components"]

    def with_component(i, **change):
        comps = [dict(c) for c in dgd["spec"]["components"]]
        comps[i] = {**comps[i], **change}
        return {**dgd, "spec": {**dgd["spec"], "components": comps}}

    assert any("workers" in e for e in crd_errors(with_component(1, type="workers")))
    assert any("replica" in e for e in crd_errors(with_component(1, replica=2)))
    assert crd_errors(with_component(1, multinode={"nodeCount": 1}))  # two nodes at least
    assert crd_errors(with_component(1, name="pre_fill"))  # not a DNS-style name
    assert any("backendFramwork" in e for e in crd_errors({**dgd, "spec": {**dgd["spec"], "backendFramwork": "x"}}))
    bad = _pod_template(pre)
    bad["template"] = {
        **bad["template"],
        "spec": {
            **bad["template"]["spec"],
            "containers": [{**bad["template"]["spec"]["containers"][0], "volumeMount": []}],
        },
    }
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.30.0", strict=True)


def _wheel():
    from trtpipe.errors import ServingError
    from trtpipe.app.launch_dynamo import dynamo_python

    try:
        venv = dynamo_python().parent.parent
    except ServingError as e:
        pytest.skip(str(e))
    found = sorted(venv.glob("lib/python3*/site-packages/dynamo"))
    if not found:
        pytest.skip(f"no dynamo package under {venv}")
    return found[0]


def _flag_names(path):
    return set(re.findall(r'flag_name="(--[a-z0-9-]+)"', path.read_text()))


@pytest.mark.slow  # reads NVIDIA Dynamo's venv
def test_flags_are_ones_the_installed_wheel_defines():
    """dynamo.trtllm's parser imports tensorrt_llm (not installable here), so its flag definitions are read as text:
    every flag trtpipe passes is one of them, and the disaggregation modes and router modes are its choices."""
    wheel = _wheel()
    # dynamo.trtllm's Config is DynamoRuntimeConfig + DynamoTrtllmConfig (trtllm/args.py): the runtime group's flags
    # (--dyn-tool-call-parser, --dyn-reasoning-parser, ...) are the worker's too
    assert "DynamoRuntimeArgGroup" in (wheel / "trtllm" / "args.py").read_text()
    trtllm = _flag_names(wheel / "trtllm" / "backend_args.py") | _flag_names(
        wheel / "common" / "configuration" / "groups" / "runtime_args.py"
    )
    front = _flag_names(wheel / "frontend" / "frontend_args.py") | _flag_names(
        wheel / "common" / "configuration" / "groups" / "router_args.py"
    )
    modes = set(re.findall(r'= "([a-z_]+)"', (wheel / "trtllm" / "constants.py").read_text()))
    for path, disagg in CASES + [(MULTI_NODE, False)]:
        overrides = ("target=llmapi",) if path == MULTI_NODE else ()
        _, r = _rendered(path, disagg, "kv", overrides)
        for c in _dgd(r)["spec"]["components"]:
            args = c["podTemplate"]["spec"]["containers"][0]["args"]
            flags = {a for a in args if a.startswith("--")}
            assert flags <= (front if c["type"] == "frontend" else trtllm), flags - trtllm
            if "--disaggregation-mode" in args:
                assert _flag(args, "--disaggregation-mode") in modes
    router = (wheel / "common" / "configuration" / "groups" / "router_args.py").read_text()
    assert '"kv"' in router and '"round-robin"' in router


@pytest.mark.slow  # reads NVIDIA Dynamo's venv
@pytest.mark.parametrize("name", ["agg", "disagg"])
def test_the_wheels_own_templates_pass_the_derived_schema(name):
    """The version-matched templates ai-dynamo 1.6.1 ships are valid under the schema (so it is not too strict)."""
    dgd = yaml.safe_load((_wheel() / "profiler" / "templates" / "dgd" / "trtllm" / f"{name}.yaml").read_text())
    _check_graph(dgd)


def _shell_check(path):
    if shutil.which("shellcheck"):
        done = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True, timeout=60)
    else:
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path, disagg", [(STORIES, True), (LLAMA70, False)], ids=["stories-disagg", "70b-agg"])
def test_cli_writes_the_graph_and_the_same_graph_for_one_host(tmp_path, path, disagg):
    out = tmp_path / "dyn"
    result = run_cli("deploy", "dynamo", str(path), "-o", str(out), *(["--disagg"] if disagg else []))
    assert result.exit_code == 0, result.stderr
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert all((out / f).is_file() for f in kust["resources"])
    dgd = yaml.safe_load(next(out.glob("dynamographdeployment-*.yaml")).read_text())
    _check_graph(dgd)
    script = out / "launch.sh"
    assert script.stat().st_mode & 0o111
    _shell_check(script)
    lines = script.read_text().splitlines()
    front = next(ln for ln in lines if "dynamo.frontend" in ln)
    assert "--router-mode kv" in front and "--http-host 127.0.0.1" in front
    assert "export DYN_FILE_KV DYN_DISCOVERY_BACKEND=file" in script.read_text()
    local = [shlex.split(ln.rstrip("&")) for ln in lines if "dynamo.trtllm" in ln and not ln.startswith("#")]
    workers = [c for c in dgd["spec"]["components"] if c["type"] != "frontend"]
    recipe = load_recipe(path)
    per_role = len(local) // len(workers)
    assert per_role == (1 if disagg else recipe.deploy.replicas.min)  # 2 x 4 GPUs fit the 70B's 8-GPU node
    gpus_seen = []
    for i, cmd in enumerate(local):
        w = workers[i // per_role]
        env = dict(a.split("=", 1) for a in cmd[:2])
        argv = cmd[cmd.index("dynamo.trtllm") + 1 :]
        want = w["podTemplate"]["spec"]["containers"][0]["args"]
        # the same flags; only the model and engine paths are the host's
        assert [a for a in argv if a.startswith("--")] == [a for a in want if a.startswith("--")]
        assert _flag(argv, "--kv-block-size") == _flag(want, "--kv-block-size")
        assert _flag(argv, "--model") == "$MODEL_DIR"
        engine = yaml.safe_load((out / _flag(argv, "--extra-engine-args").replace("$HERE/", "")).read_text())
        cm = next(
            yaml.safe_load(p.read_text())
            for p in out.glob("configmap-*.yaml")
            if w["podTemplate"]["spec"]["volumes"][1]["configMap"]["name"] in p.name
        )
        assert engine == yaml.safe_load(cm["data"]["engine.yaml"])
        gpus_seen += env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == recipe.parallel.tp * recipe.parallel.pp
    assert len(gpus_seen) == len(set(gpus_seen)) <= recipe.deploy.gpus_per_node  # one GPU per rank, none shared
    again = run_cli("deploy", "dynamo", str(path), "-o", str(out))
    assert again.exit_code != 0 and "exists and is not empty" in again.stderr


def test_an_engine_recipe_is_refused_in_one_line(tmp_path):
    result = run_cli("deploy", "dynamo", str(RECIPES / "llama70b-fp8.yaml"), "-o", str(tmp_path / "x"))
    assert result.exit_code != 0 and "target: engine" in result.stderr and "llmapi" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_no_launch_script_when_one_worker_spans_nodes(tmp_path):
    out = tmp_path / "m"
    result = run_cli("deploy", "dynamo", str(MULTI_NODE), "--set", "target=llmapi", "-o", str(out))
    assert result.exit_code == 0, result.stderr
    assert not (out / "launch.sh").exists() and "No launch.sh" in (out / "SOURCES.md").read_text()
