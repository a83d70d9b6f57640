"""The recipe's ``lora:`` section: adapters checked against the base at validation (one line naming the adapter
and key), the trtllm-serve YAML's ``lora_config`` with target modules derived from the adapters, the adapters
copied beside the export, and Dynamo refused with its reason."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from trtpipe.app.validation import check_recipe, load_recipe
from trtpipe.export.lora import TRTLLM_MODULES, dynamo_refusal
from trtpipe.export.serving import write_serving
from trtpipe.triton.llmapi_repo import write_llmapi_repo

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _recipe(tmp_path, stories_dir, adapters: dict, **sections) -> object:
    doc = {
        "name": "stories-lora",
        "target": "llmapi",
        "model": {"source": str(stories_dir)},
        "accuracy": {"enabled": False},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 2048},
        "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, "max_lora_rank": 64},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_recipe(path, check_rules=False)


def _problems(recipe) -> dict[str, str]:
    return {p.key: p.message for p in check_recipe(recipe)}


def test_valid_recipe_writes_lora_config_and_copies(tmp_path, stories_dir, adapters):
    picked = {k: adapters[k] for k in ("r8-attn", "r64-all")}
    recipe = _recipe(tmp_path, stories_dir, picked)
    assert _problems(recipe) == {}
    out = tmp_path / "out"
    out.mkdir()
    info = write_serving(recipe, stories_dir, out)
    lora = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["lora_config"]
    assert lora == {
        "lora_dir": [str((out / "lora" / n).resolve()) for n in picked],
        "lora_ckpt_source": "hf",
        "max_lora_rank": 64,
        "max_loras": 4,
        "max_cpu_loras": 8,
        "lora_target_modules": list(TRTLLM_MODULES.values()),  # r64-all targets every linear: all seven, in order
    }
    for n, src in picked.items():
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            assert (out / "lora" / n / f).read_bytes() == (src / f).read_bytes()
    write_llmapi_repo(recipe, out / "triton_repo", str(stories_dir), out / "lora")
    model = yaml.safe_load((out / "triton_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model["lora_config"] == lora
    assert info["lora_dir"] == str((out / "lora").resolve())
    only_attn = _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    write_serving(only_attn, stories_dir, out)
    lora = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["lora_config"]
    assert lora["lora_target_modules"] == ["attn_q", "attn_k", "attn_v", "attn_dense"]


def test_refusals_name_adapter_and_key(tmp_path, stories_dir, adapters):
    bad = tmp_path / "dora"
    shutil.copytree(adapters["r8-attn"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    recipe = _recipe(
        tmp_path,
        stories_dir,
        {"r64-all": adapters["r64-all"], "dora": bad, "gone": tmp_path / "missing"},
        lora={"max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 2},
        quantization={"algo": "int4_awq"},
        llmapi={"version": "1.1"},
    )
    problems = _problems(recipe)
    assert problems["lora.adapters.r64-all"] == "adapter 'r64-all': rank r=64 is above lora.max_lora_rank 16"
    assert (
        "adapter 'dora'" in problems["lora.adapters.dora"]
        and "key 'use_dora' is True" in problems["lora.adapters.dora"]
    )
    assert "adapter 'gone'" in problems["lora.adapters.gone"] and "does not exist" in problems["lora.adapters.gone"]
    assert "FP8 base only" in problems["quantization.algo"]
    assert "1.2 only" in problems["llmapi.version"]
    assert "below lora.max_loras 4" in problems["lora.max_cpu_loras"]
    engine = _recipe(
        tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]}, target="engine", triton={"max_batch_size": 8}
    )
    assert _problems(engine) == {}  # built now (tests/lora/test_lora_engine.py)


def test_dynamo_refused_with_reason(tmp_path, stories_dir, adapters):
    recipe = _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    why = dynamo_refusal(recipe)
    assert "Dynamo does not serve LoRA adapters on TensorRT-LLM" in why and "feature-matrix" in why
    assert dynamo_refusal(_recipe(tmp_path, stories_dir, {})) is None


def test_deploy_dynamo_refuses_lora_recipe(tmp_path, stories_dir, adapters):
    from click.testing import CliRunner

    from trtpipe.cli import main

    _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    result = CliRunner().invoke(main, ["deploy", "dynamo", str(tmp_path / "recipe.yaml"), "-o", str(tmp_path / "dyn")])
    assert result.exit_code == 2, result.output
    assert "Dynamo does not serve LoRA adapters on TensorRT-LLM" in result.output
    assert not (tmp_path / "dyn").exists()  # nothing half-written


def test_plan_prints_the_lora_cache_line(tmp_path, stories_dir, adapters):
    """r64-all on stories260k: 5 layers x r 64 x (q 64+64, k 64+32, v 64+32, o 64+64, gate/up/down 64+172 each)
    = 369,920 parameters, 0.71 MiB at the plan's float16 (a float32 source becomes float16)."""
    from click.testing import CliRunner

    from trtpipe.cli import main
    from trtpipe.export.lora import adapter_params

    recipe = _recipe(tmp_path, stories_dir, {k: adapters[k] for k in ("r8-attn", "r64-all")})
    per_layer = 64 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 172))
    assert adapter_params(recipe)["r64-all"] == 5 * per_layer == 369_920
    result = CliRunner().invoke(main, ["plan", str(tmp_path / "recipe.yaml")])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("LoRA cache"))
    assert "2 adapters, largest 'r64-all' 0.71 MiB" in line and "device max_loras 4 x that = 2.82 MiB" in line


def test_deploy_k8s_names_the_adapters_on_the_volume(tmp_path, stories_dir, adapters):
    """The llmapi pod serves /artifacts/hf with /artifacts/extra_llm_api_options.yaml: deploy k8s writes that YAML
    with lora_dir under /artifacts/lora, and SOURCES.md says to copy lora/ there."""
    from click.testing import CliRunner

    from trtpipe.cli import main

    _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    result = CliRunner().invoke(main, ["deploy", "k8s", str(tmp_path / "recipe.yaml"), "-o", str(tmp_path / "k8s")])
    assert result.exit_code == 0, result.output
    lora = yaml.safe_load((tmp_path / "k8s" / "extra_llm_api_options.yaml").read_text())["lora_config"]
    assert lora["lora_dir"] == ["/artifacts/lora/r8-attn"]
    assert lora["lora_target_modules"] == ["attn_q", "attn_k", "attn_v", "attn_dense"]
    assert "copy the `llmapi` stage's `lora/`" in (tmp_path / "k8s" / "SOURCES.md").read_text()
    manifests = "".join(p.read_text() for p in (tmp_path / "k8s").glob("*.yaml"))
    assert "/artifacts" in manifests  # the pod mounts the artifact volume there


@pytest.mark.slow
def test_serve_target_of_a_lora_recipe(tmp_path, stories_dir, adapters):
    """What `trtpipe serve RECIPE` runs: the export built, the recipe's adapters and max_loras handed to the twin,
    and an adapter answered by name on the exported (float16) checkpoint."""
    from trtpipe.app.launch_openai import resolve_openai_target
    from trtpipe.serving.api import Request
    from trtpipe.serving.openai_server import ServedModel

    _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]}, lora={"max_loras": 1, "max_cpu_loras": 1})
    t = resolve_openai_target(tmp_path / "recipe.yaml")
    assert t.lora.adapters == {"r8-attn": adapters["r8-attn"]} and t.config.max_loras == 1
    served = ServedModel(t.model_dir, t.name, t.config, lora=t.lora)
    try:
        assert served.adapters.names == ["r8-attn"] and served.config.max_loras == 1
        answers = {}
        for lora in ("r8-attn", None):
            done = __import__("threading").Event()
            req = Request([1, 403, 407, 261], 8, exclude_input_from_output=True, lora=lora)
            served.executor.submit(
                req, lambda r, lora=lora: (answers.__setitem__(lora, r), done.set()) if r.is_final else None
            )
            assert done.wait(120)
            assert not answers[lora].has_error, answers[lora].error
        assert answers["r8-attn"].tokens != answers[None].tokens
    finally:
        served.shutdown()


def test_serve_dynamo_refuses_lora_recipe_before_building(tmp_path, stories_dir, adapters):
    from trtpipe.app.launch_dynamo import resolve_graph
    from trtpipe.errors import ServingError

    _recipe(tmp_path, stories_dir, {"r8-attn": adapters["r8-attn"]})
    with pytest.raises(ServingError, match="Dynamo does not serve LoRA adapters on TensorRT-LLM"):
        resolve_graph(tmp_path / "recipe.yaml", (), None, None, None, 1, "kv")
    assert not (tmp_path / "work").exists()  # refused before any stage ran
