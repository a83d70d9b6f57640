"""The two-model draft-target form on TensorRT engines at tp x pp > 1 is launched in orchestrator mode, as upstream's
"Speculative Sampling" guide does (TensorRT-LLM docs/source/advanced/speculative-decoding.md@8babaf8a: "``--multi-model``
is necessary if TP mode is used for target model", the draft on GPU 0, the target on the GPUs after it), in every place
trtpipe writes the launch: the repository's ``gpu_device_ids``, ``trtpipe serve --dry-run`` of a built repository and
of a recipe, and the Kubernetes manifests. The flags are those of launch_triton_server.py's ``--multi-model``
(triton-inference-server/tensorrtllm_backend scripts/launch_triton_server.py@dbae4e88: TRTLLM_ORCHESTRATOR=1,
TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1, world size 1, ``--pinned-memory-pool-byte-size=0 --enable-peer-access=false``
and ``--cuda-memory-pool-byte-size=J:0`` per GPU). What cannot be placed is refused in one line naming the key."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from trtpipe.cli import main
from trtpipe.errors import ServingError, TrtpipeError
from trtpipe.triton import repo as R
from trtpipe.app.validation import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LLAMA70B = RECIPES / "llama70b-fp8.yaml"  # tp 4
TWO_MODEL = (
    "speculative.decoding_type=draft_tokens_external",
    "speculative.speculative_model=/draft",
    "speculative.max_draft_len=3",
)
ORCH_PREFIX = ["env", "TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1", "mpirun", "--allow-run-as-root"]


def _engine(recipe, out: Path) -> Path:
    """The engine config.json trtllm-build would write for ``recipe`` (from the engine planner)."""
    from trtpipe.engine import build_config as bc
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config

    cfg = predicted_checkpoint_config(read_hf_config(recipe.resolve(recipe.model.source)), recipe)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(bc.engine_config_json(cfg, bc.resolve_build(recipe, cfg).config)))
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orch")
    target = _engine(load_recipe(LLAMA70B, TWO_MODEL, check_rules=False), tmp / "target")
    draft = _engine(load_recipe(LLAMA70B, check_rules=False), tmp / "draft")  # sharded in the same tp 4
    return target, draft


@pytest.fixture(scope="module")
def repo(engines, tmp_path_factory, tokenizer_with_eos):
    target, draft = engines
    tok = tokenizer_with_eos(tmp_path_factory.mktemp("tok") / "tokenizer", [2])
    out = tmp_path_factory.mktemp("repo") / "repo"
    R.write_repo(load_recipe(LLAMA70B, TWO_MODEL, check_rules=False), target, tok, out, draft)
    return out


def _param(repo: Path, model: str, key: str) -> str:
    config = text_format.Parse((repo / model / "config.pbtxt").read_text(), mc.ModelConfig())
    return config.parameters[key].string_value


def _dry_run(target: Path, *extra: str):
    ports = ["--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
    return CliRunner().invoke(main, ["serve", str(target), "--dry-run", *ports, *extra])


def _check_orchestrator(cmd: list[str], repo: str, gpus: int) -> None:
    """One tritonserver under ``mpirun -n 1`` with launch_triton_server.py --multi-model's environment and flags."""
    assert cmd[: len(ORCH_PREFIX)] == ORCH_PREFIX
    rest = cmd[len(ORCH_PREFIX) :]
    assert rest[:4] == ["-n", "1", "/opt/tritonserver/bin/tritonserver", f"--model-repository={repo}"]
    assert ":" not in cmd and cmd.count("/opt/tritonserver/bin/tritonserver") == 1
    assert not any(a.startswith(("--load-model", "--model-control-mode")) for a in cmd)  # every model loads
    assert {"--pinned-memory-pool-byte-size=0", "--enable-peer-access=false", "--disable-auto-complete-config"} <= set(
        cmd
    )
    assert [a for a in cmd if a.startswith("--cuda-memory-pool-byte-size=")] == [
        f"--cuda-memory-pool-byte-size={j}:0" for j in range(gpus)
    ]
    assert "--backend-config=python,shm-region-prefix-name=prefix0_" in cmd


def test_each_model_gets_its_own_gpus_as_upstreams_guide_places_them(repo):
    assert _param(repo, "tensorrt_llm_draft", "gpu_device_ids") == "0,1,2,3"  # the draft first (DRAFT "0")
    assert _param(repo, "tensorrt_llm", "gpu_device_ids") == "4,5,6,7"  # then the target (TARGET "1,2,3,4")
    assert (
        _param(repo, "tensorrt_llm", "participant_ids") == "" == _param(repo, "tensorrt_llm_draft", "participant_ids")
    )
    assert _param(repo, "tensorrt_llm_bls", "tensorrt_llm_draft_model_name") == "tensorrt_llm_draft"


def test_a_plain_tp4_repository_stays_in_leader_mode(engines, tmp_path, tokenizer_with_eos):
    _, draft = engines
    out = tmp_path / "plain"
    R.write_repo(load_recipe(LLAMA70B, check_rules=False), draft, tokenizer_with_eos(tmp_path / "tok", [2]), out)
    assert _param(out, "tensorrt_llm", "gpu_device_ids") == ""
    res = _dry_run(out)
    assert res.exit_code == 0 and "leader mode" in res.output
    assert shlex.split(res.output.strip().splitlines()[-1]).count(":") == 3


def test_serve_dry_run_of_the_repository_is_orchestrator_mode(repo):
    res = _dry_run(repo)
    assert res.exit_code == 0, res.output
    assert "orchestrator mode" in res.output and "--multi-model" in res.output
    _check_orchestrator(shlex.split(res.output.strip().splitlines()[-1]), str(repo.resolve()), 8)


def test_serve_dry_run_of_the_recipe_is_orchestrator_mode(tmp_path, stories_dir):
    """A recipe planned, not built: stories260k at tp 2 with itself as the draft (the rules pass)."""
    text = (RECIPES / "stories-fp16.yaml").read_text().replace("../models/stories260k", str(stories_dir))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text.replace("work_dir: work/", f"work_dir: {tmp_path}/work/"))
    sets = ["parallel.tp=2", "speculative.decoding_type=draft_tokens_external"]
    sets += [f"speculative.speculative_model={stories_dir}", "speculative.max_draft_len=3"]
    res = _dry_run(recipe, *[a for s in sets for a in ("--set", s)])
    assert res.exit_code == 0, res.output
    cmd = shlex.split(res.output.strip().splitlines()[-1])
    repo = next(a for a in cmd if a.startswith("--model-repository=")).split("=", 1)[1]
    _check_orchestrator(cmd, repo, 4)
    res = _dry_run(recipe, *[a for s in sets + ["deploy.gpus_per_node=2"] for a in ("--set", s)])
    assert res.exit_code == 2  # the recipe's own rules refuse it (deploy.layout_of), before anything is planned
    assert "deploy.gpus_per_node: the two-model form at tp x pp 2 runs in orchestrator mode" in res.output
    assert "needs 4 GPUs (draft on 0..1, target on 2..3); the node has 2" in res.output


def test_placement_that_does_not_match_the_engines_is_refused_in_one_line(repo, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(repo, bad, symlinks=True)
    path = bad / "tensorrt_llm_draft" / "config.pbtxt"
    path.write_text(path.read_text().replace('string_value: "0,1,2,3"', 'string_value: "0,1"'))
    res = _dry_run(bad)
    assert res.exit_code == 1
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert "tensorrt_llm_draft/config.pbtxt: gpu_device_ids '0,1' must name 4 distinct GPUs" in lines[0]
    (tmp_path / "hosts").write_text("node-a:8\nnode-b:8\n")
    res = _dry_run(repo, "--hostfile", str(tmp_path / "hosts"))
    assert res.exit_code != 0 and "orchestrator mode, on one node" in res.output


def test_more_gpus_than_the_node_has_writes_nothing(engines, tmp_path, tokenizer_with_eos):
    target, draft = engines
    recipe = load_recipe(LLAMA70B, [*TWO_MODEL, "deploy.gpus_per_node=4"], check_rules=False)
    out = tmp_path / "repo"
    with pytest.raises(ServingError, match=r"deploy.gpus_per_node: .* needs GPUs 0..7 .*the node has 4$"):
        R.write_repo(recipe, target, tokenizer_with_eos(tmp_path / "tok", [2]), out, draft)
    assert not out.exists() and not list(tmp_path.glob(".repo.tmp*"))


def test_kubernetes_pod_runs_the_orchestrator_on_both_models_gpus():
    from trtpipe.deploy.k8s import render
    from trtpipe.deploy.layout import layout_of

    recipe = load_recipe(LLAMA70B, TWO_MODEL, check_rules=False)
    assert (layout_of(recipe).gpus_per_pod, layout_of(recipe).pods) == (8, 1)
    objects = render(recipe, 17 << 30).objects
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    cmd = c["command"]
    _check_orchestrator(
        [
            a
            for a in cmd
            if not a.startswith(("--strict-readiness", "--exit-timeout", "--metrics-", "--allow-cpu", "--allow-gpu"))
        ],
        "/artifacts/triton_repo",
        8,
    )
    assert "--metrics-config=histogram_latencies=true" in cmd and "--http-address=0.0.0.0" in cmd
    assert any(a.startswith("--http-restricted-api=") and a.endswith("$(TRTPIPE_ADMIN_KEY)") for a in cmd)
    with pytest.raises(TrtpipeError, match=r"^deploy.gpus_per_node: .* needs 8 GPUs .*the node has 4$"):
        layout_of(load_recipe(LLAMA70B, [*TWO_MODEL, "deploy.gpus_per_node=4"], check_rules=False))
