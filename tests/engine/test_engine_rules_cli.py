"""Validation-time engine rules (file:line:col + reason) and the plan / doctor commands."""

from __future__ import annotations

import json
import re
import time

import pytest
from click.testing import CliRunner

from engine_helpers import CONFIGS, REPO
from trtpipe.cli import main
from trtpipe.errors import RecipeError
from trtpipe.app.validation import load_recipe
from optional import needs

# 'self' data needs the whole float32 model on the host (refused for these models): name the sample files
CALIB = f"  calibration: {{dataset: {REPO}/recipes/data/calibration-sample.jsonl}}\n"
EVAL = f"accuracy: {{eval_data: {REPO}/recipes/data/eval-sample.jsonl}}\n"


def problems(path) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    return [str(p) for p in exc.value.problems]


def test_named_fp8_preset_without_fp8_kv_is_reported_at_the_preset_line(make_recipe):
    path = make_recipe("quantization:\n  algo: fp8\n" + CALIB + "engine:\n  plugins: hopper-fp8\n" + EVAL)
    (msg,) = problems(path)
    assert msg.startswith(f"{path}:8:12: engine.plugins.preset: use_fp8_context_fmha would be changed by trtllm-build")
    assert "FP8 paged context FMHA needs an FP8 KV cache" in msg


def test_override_rewrites_are_reported_at_the_override(make_recipe):
    path = make_recipe("engine:\n  plugins:\n    overrides:\n      reduce_fusion: enable\n")
    (msg,) = problems(path)
    assert msg.startswith(f"{path}:7:22: engine.plugins.overrides.reduce_fusion:") and "needs tp > 1" in msg


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            "quantization:\n  algo: int4_awq\nengine:\n  gpu: b200-180gb\n",
            "quantization.algo: trtllm-build rejects this: weight-only W4A16_AWQ",
        ),
        ("quantization:\n  algo: int8_sq\nengine:\n  gpu: b200\n", "SmoothQuant W8A8_SQ_PER_CHANNEL is rejected"),
        ("quantization:\n  algo: fp8\nengine:\n  gpu: a100-sxm-80gb\n", "FP8 needs FP8 tensor cores (SM >= 8.9)"),
        ("engine:\n  gpu: h100-sxm-80\n", "unknown GPU 'h100-sxm-80'; did you mean 'h100-sxm-80gb'?"),
        ("engine:\n  plugins: hoper-fp8\n", "unknown preset 'hoper-fp8'; did you mean 'hopper-fp8'?"),
        (
            "engine:\n  plugins:\n    overrides: {use_paged_ctx_fmha: true}\n",
            "unknown plugin field 'use_paged_ctx_fmha'",
        ),
        ("engine:\n  plugins:\n    overrides: {context_fmha: maybe}\n", "context_fmha must be true/false"),
        ("engine:\n  plugins:\n    overrides: {remove_input_padding: false}\n", "in-flight batching"),
        (
            "engine:\n  plugins:\n    overrides: {use_paged_context_fmha: false}\n",
            "engine.kv_cache.enable_reuse: KV reuse needs paged context FMHA",
        ),
    ],
)
def test_rejections_and_names(make_recipe, body, needle):
    msgs = problems(make_recipe(body))
    assert any(needle in m for m in msgs), msgs


def test_planner_refusal_at_validation(make_recipe):
    body = (
        "quantization:\n  algo: fp8\n  kv_cache: fp8\n" + CALIB + "engine:\n  gpu: rtx-4090-24gb\n"
        "  max_seq_len: 8192\n" + EVAL
    )
    (msg,) = problems(make_recipe(body, config="llama-3.1-70b"))
    assert ":9:8: engine.gpu: does not fit: per-GPU weights 67.7 GiB" in msg and msg.endswith(
        "turn a knob: parallel.tp: 4"
    )
    # at the deduced 131072-token context one sequence's KV needs tp 8 on 24 GB cards
    (msg,) = problems(make_recipe(body.replace("  max_seq_len: 8192\n", ""), config="llama-3.1-70b", name="long"))
    assert msg.endswith("turn a knob: parallel.tp: 8")


def test_valid_recipe_and_rules_are_fast(make_recipe):
    path = make_recipe(
        "quantization:\n  algo: fp8\n  kv_cache: fp8\n" + CALIB + "parallel:\n  tp: 4\n" + EVAL, config="llama-3.1-70b"
    )
    load_recipe(path)
    start = time.perf_counter()
    for _ in range(10):
        load_recipe(path)
    assert (time.perf_counter() - start) / 10 < 0.5


def test_plan_llama70b_fp8_on_4x_h100_and_on_one_rtx4090():
    recipe = REPO / "recipes" / "llama70b-fp8.yaml"
    res = CliRunner().invoke(main, ["plan", str(recipe)])
    assert res.exit_code == 0, res.output
    assert (
        "4 x NVIDIA H100 80GB HBM3" in res.output
        and "KV bytes/token: 163840 for the whole model; per GPU 40960" in res.output
    )
    assert res.output.rstrip().endswith("fits")
    res = CliRunner().invoke(
        main,
        [
            "plan",
            str(recipe),
            "--gpu",
            "rtx-4090-24gb",
            "--set",
            "parallel.tp=1",
            "--set",
            "engine.workers=1",
            "--json",
        ],
    )
    assert res.exit_code == 3, res.output
    data = json.loads(res.output)
    assert data["fits"] is False and data["refusal"].startswith("does not fit: per-GPU weights 67.7 GiB")
    assert data["kv_bytes_per_token_model"] == 163840


def test_plan_with_model_config_and_list_gpus(make_recipe, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: big\nmodel:\n  source: /nowhere/Llama-2-13b-hf\nengine:\n  gpu: a100-sxm-80gb\n")
    res = CliRunner().invoke(main, ["plan", str(path)])
    assert res.exit_code == 1 and "--model-config" in res.output
    res = CliRunner().invoke(
        main, ["plan", str(path), "--model-config", str(CONFIGS / "llama-2-13b" / "config.json"), "--json"]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["kv_bytes_per_token_model"] == 2 * 40 * 40 * 128 * 2 and data["preset"] == "ampere-fp16"
    assert data["fits"] and data["concurrent_sequences"] >= 1
    res = CliRunner().invoke(main, ["plan", "--list-gpus"])
    assert res.exit_code == 0 and "rtx-4090-24gb" in res.output and "b200-180gb" in res.output


def _machine() -> tuple[list[dict], bool]:
    """What doctor should find on this machine: its GPUs, and whether TensorRT-LLM is installed (the tests hold
    on a GPU host too, saying what it has)."""
    from trtpipe.pipeline import versions

    return versions.query_gpus()[0], versions.package_version("tensorrt_llm") is not None


@needs("pytriton")
def test_doctor_says_what_gpu_and_trtllm_are_here():
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 0, res.output
    gpus, trtllm = _machine()
    if gpus:
        assert gpus[0]["name"] in res.output
    else:
        assert "no CUDA GPU visible" in res.output
    if not trtllm:
        assert (
            "TensorRT-LLM   not installed" in res.output
            and "TensorRT engines need TensorRT-LLM 1.2.x on a GPU" in res.output
        )
    assert "tritonserver" in res.output and "backends: python" in res.output


@needs("pytriton")
def test_doctor_against_engine_dirs(tmp_path):
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "config.json").write_text(
        json.dumps({"version": "1.2.1", "pretrained_config": {"mapping": {"world_size": 1}}, "build_config": {}})
    )
    (twin / "trtpipe_twin.json").write_text(json.dumps({"kind": "cpu-twin"}))
    res = CliRunner().invoke(main, ["doctor", str(twin)])
    assert res.exit_code == 0, res.output
    # a real engine dir (config.json + lockfile, as trtllm-build and the engine stage write them)
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(
        json.dumps(
            {
                "version": "1.2.1",
                "pretrained_config": {"mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1}},
                "build_config": {},
            }
        )
    )
    (real / "trtpipe_lock.json").write_text(
        json.dumps(
            {
                "lockfile": {
                    "tensorrt_llm": "1.2.1",
                    "tensorrt": "10.14.1.48",
                    "cuda": "13.0",
                    "driver": "580.95",
                    "gpus": [{"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}],
                }
            }
        )
    )
    res = CliRunner().invoke(main, ["doctor", str(real)])
    gpus, trtllm = _machine()
    if trtllm:
        pytest.skip("TensorRT-LLM is installed here: the missing-install advice below cannot be shown")
    assert res.exit_code == 1
    out = res.output
    assert "[MISS] TensorRT-LLM   not installed  (engine needs: 1.2.1)" in out
    assert "install TensorRT-LLM 1.2.1" in out and "install TensorRT 10.14.1.48" in out
    if not gpus:
        assert "run on a machine with 2 GPU(s) of SM 9.0" in out
    elif "9.0" not in {g["compute_capability"] for g in gpus}:
        assert "engines only load on the SM they were built for" in out
    assert "the tensorrtllm backend" in out


@pytest.mark.parametrize(
    "recipe,sets,want",
    [
        # FP8 Qwen3-235B on two H100: int4_awq experts are refused on llmapi (W4A8 only), so the 4-bit advice is w4a8_awq
        ("qwen3-235b-a22b-fp8.yaml", ["parallel.tp=2", "parallel.moe_ep=2"], "w4a8_awq"),
        # on one B200 the Blackwell 4-bit format, which trtpipe's llmapi export writes for MoE experts
        ("qwen3-235b-a22b-fp8.yaml", ["parallel.tp=1", "parallel.moe_ep=1", "engine.gpu=b200-180gb"], "nvfp4"),
        # engine target, bf16 Llama 3.1 70B on one H100: FP8 halves the weights and fits
        (
            "llama70b-fp8.yaml",
            ["parallel.tp=1", "engine.workers=1", "quantization.algo=none", "quantization.kv_cache=none"],
            "fp8",
        ),
        # engine target, bf16 Llama 3.1 70B on one A100 (no FP8): group-wise INT4
        (
            "llama70b-fp8.yaml",
            [
                "parallel.tp=1",
                "engine.workers=1",
                "quantization.algo=none",
                "quantization.kv_cache=none",
                "engine.gpu=a100-sxm-80gb",
            ],
            "int4_awq",
        ),
    ],
)
def test_refusal_advice_names_an_algo_the_recipe_then_takes(recipe, sets, want):
    """The quantization the refusal advises passes validation and fits when followed: it named int4_awq for the MoE
    experts of an llmapi recipe, which validation then refuses (TensorRT-LLM's fused MoE loads int4 experts only as
    W4A8), a round trip for the user."""
    path = REPO / "recipes" / recipe
    with pytest.raises(RecipeError) as exc:
        load_recipe(path, sets)
    (msg,) = [str(p) for p in exc.value.problems]
    knob = re.search(r"quantization\.algo: (\w+)", msg.split("turn a knob:", 1)[1])
    assert knob and knob.group(1) == want, msg
    load_recipe(path, [*sets, f"quantization.algo={want}"])  # raises if the advice is refused or still does not fit


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["quantization.algo=nvfp4"], "NVFP4 needs FP4 tensor cores (SM >= 10.0, Blackwell); the target is SM 9.0"),
        (["engine.gpu=a100-sxm-80gb"], "FP8 needs FP8 tensor cores (SM >= 8.9); the target is SM 8.0"),
        (["quantization.algo=w4a8_awq", "engine.gpu=a100-sxm-80gb"], "W4A8_AWQ needs FP8 tensor cores (SM >= 8.9)"),
    ],
)
def test_llmapi_recipe_needs_the_tensor_cores_of_its_format(sets, needle):
    """The llmapi target has no trtllm-build, but its GEMMs need the same tensor cores: NVFP4 on an H100, or FP8 on an
    A100, passed validation and would have failed when TensorRT-LLM loaded the checkpoint on the GPU."""
    path = REPO / "recipes" / "qwen3-30b-a3b-fp8.yaml"  # target: llmapi, FP8 on one H100
    with pytest.raises(RecipeError) as exc:
        load_recipe(path, sets)
    (msg,) = [str(p) for p in exc.value.problems]
    assert "quantization.algo: " + needle in msg, msg
    load_recipe(path, ["quantization.algo=nvfp4", "engine.gpu=b200-180gb"])  # Blackwell runs FP4
