"""A pre-quantized checkpoint as ``model.source`` of a recipe: validate refuses double quantization and what the
target cannot load, with the reason and the alternative; ``build`` converts it for the engine target (the issue's
first failure: its FP8 export made the checkpoint stage fail on ``down_proj.input_scale``) and passes it through
for the llmapi target; ``inspect`` says the format in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from imported_helpers import assert_logits_match
from trtpipe.cli import main
from trtpipe.engine.ckptconfig import predicted_checkpoint_config
from trtpipe.engine.planner import Shapes, weight_bytes
from trtpipe.app.planning import model_info
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.app.validation import check_recipe, load_recipe
from optional import needs


def _recipe(tmp_path: Path, source: Path, body: str = "", target: str = "engine", lossy: str = "") -> Path:
    p = tmp_path / f"r-{target}.yaml"
    lossy = f"  allow_lossy_import: {lossy}\n" if lossy else ""
    p.write_text(
        f"name: t\nwork_dir: {tmp_path / ('w-' + target)}\ntarget: {target}\nmodel:\n  source: {source}\n"
        f"  dtype: bfloat16\n{lossy}triton:\n  max_batch_size: 8\nengine:\n  max_batch_size: 8\n  max_input_len: 64\n"
        f"  max_seq_len: 128\n  max_num_tokens: 256\n{body}"
    )
    return p


def _problems(path: Path) -> list:
    return check_recipe(load_recipe(path, check_rules=False))


def test_double_quantization_is_refused_naming_the_format(tmp_path, unified):
    p = _recipe(tmp_path, unified("fp8"), "quantization:\n  algo: int4_awq\n  kv_cache: fp8\n")
    r = CliRunner().invoke(main, ["validate", str(p)])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if "already quantized" in line]
    assert len(lines) == 2, r.output
    assert "quantization.algo: model.source is already quantized (modelopt FP8 (8-bit weights" in lines[0]
    assert "kv cache FP8" in lines[0] and "remove quantization.algo" in lines[0]


def test_what_the_target_cannot_load_is_refused_with_the_alternative(tmp_path, stories_dir):
    src = tmp_path / "fp8-block"  # DeepSeek-style block FP8: only its config is read at validate
    shutil.copytree(stories_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (src / "config.json").write_text(json.dumps(cfg))
    msgs = [x.message for x in _problems(_recipe(tmp_path, src)) if x.key == "target"]
    assert msgs and "refused for target engine" in msgs[0] and "use target: llmapi" in msgs[0], msgs
    assert not [x for x in _problems(_recipe(tmp_path, src, target="llmapi")) if x.key == "target"]


def test_nvfp4_needs_a_blackwell_gpu_on_either_target(tmp_path, unified):
    """NVFP4 converts for the engine target, and trtllm-build's FP4 GEMM plugin needs SM >= 10.0: validate refuses
    the default engine.gpu (H100) naming engine.gpu, and accepts a B200. The llmapi target has no builder but the
    same tensor cores (the PyTorch backend's FP4 GEMMs): refused on H100 too, accepted on B200; it passed validation
    and would have failed at load on the GPU."""
    hopper = _problems(_recipe(tmp_path, unified("nvfp4")))
    assert [x.key for x in hopper] == ["engine.gpu"], hopper
    assert (
        "model.source is modelopt NVFP4" in hopper[0].message
        and "trtllm-build rejects it on h100-sxm-80gb: NVFP4 needs FP4 tensor cores (SM >= 10.0, Blackwell)"
        in hopper[0].message
    ), hopper[0].message
    assert not _problems(_recipe(tmp_path, unified("nvfp4"), "  gpu: b200-180gb\n"))
    (llmapi,) = [x for x in _problems(_recipe(tmp_path, unified("nvfp4"), target="llmapi")) if x.key == "engine.gpu"]
    assert llmapi.message.startswith(
        "model.source on h100-sxm-80gb: NVFP4 needs FP4 tensor cores (SM >= 10.0, Blackwell); the target is SM 9.0"
    ), llmapi.message
    assert not _problems(_recipe(tmp_path, unified("nvfp4"), "  gpu: b200-180gb\n", target="llmapi"))


def test_nvfp4_tp_that_splits_a_block_is_refused(tmp_path, unified):
    """A row-parallel rank must hold whole 16-input blocks (the block scales cannot be re-cut; FP4Linear asserts
    in_features % 16): stories260k's o_proj (64 inputs) at tp 8 has 8 per rank (tp 8 is refused for its intermediate
    size too, in its own line). At tp 4 its gate/up have 43 rows per rank, odd, which INT4's row pairs would refuse;
    NVFP4 packs along the inputs, so it is accepted."""
    p = _recipe(tmp_path, unified("nvfp4"), "  gpu: b200-180gb\nparallel:\n  tp: 8\n")
    msgs = [x.message for x in _problems(p) if x.key == "parallel.tp" and "NVFP4" in x.message]
    assert msgs == [
        "model.source is NVFP4 with group size 16: at tp=8 attention.dense in_features 8 per rank is not a "
        "multiple of group_size 16 (the checkpoint's groups cannot be re-cut); use a smaller tp"
    ], msgs
    assert not _problems(_recipe(tmp_path, unified("nvfp4"), "  gpu: b200-180gb\nparallel:\n  tp: 4\n"))


def test_nvfp4_fused_members_with_different_global_scales_are_refused_at_validate(tmp_path, unified):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "nvfp4"
    shutil.copytree(unified("nvfp4"), src)
    files = sorted(src.glob("*.safetensors"))
    name = "model.layers.3.self_attn.k_proj.weight_scale_2"
    for f in files:
        t = load_file(str(f))
        if name in t:
            t[name] = t[name] * 2
            save_file(t, str(f))
    found = [x for x in _problems(_recipe(tmp_path, src, "  gpu: b200-180gb\n")) if x.key == "model.source"]
    assert len(found) == 1 and found[0].message.startswith(
        "model.layers.3.self_attn: q_proj/k_proj/v_proj weight_scale_2 differ ("
    ), found
    assert "trtpipe does not requantize NVFP4 codes to share one" in found[0].message


def test_reference_is_for_pre_quantized_sources_only(tmp_path, stories_dir, unified):
    p = _recipe(tmp_path, stories_dir, f"accuracy:\n  reference: {stories_dir}\n")
    assert [x.key for x in _problems(p)] == ["accuracy.reference"]
    q = _recipe(tmp_path, unified("int4_wo"), f"accuracy:\n  reference: {unified('fp8')}\n")
    msgs = [x.message for x in _problems(q) if x.key == "accuracy.reference"]
    assert msgs and "must be unquantized" in msgs[0]
    assert not _problems(_recipe(tmp_path, unified("int4_wo"), f"accuracy:\n  reference: {stories_dir}\n"))


def test_inspect_says_the_format_in_one_line(unified):
    r = CliRunner().invoke(main, ["inspect", str(unified("int4_awq"))])
    assert r.exit_code == 0, r.output
    line = next(line for line in r.output.splitlines() if "pre_quantized:" in line)
    assert "modelopt W4A16_AWQ (4-bit weights, group size 64; kv cache unquantized; excluded:" in line
    assert "model.layers.0.mlp.down_proj" in line


@needs("tritonclient")
@pytest.mark.slow
def test_build_both_targets_from_trtpipes_own_fp8_export(tmp_path, unified):
    """The issue's repro: the FP8 + FP8-KV llmapi export as the source of a plain engine recipe, then of an llmapi
    recipe. Engine: the checkpoint stage converts (no calibrate/quantize), the engine (twin) is built, and the
    checkpoint's logits are the source's; llmapi: the export is the source file for file. The engine conversion
    requantizes fused members (their FP8 scales differ): refused, naming the step, until the recipe accepts it."""
    src = unified("fp8")
    r = CliRunner().invoke(main, ["build", str(_recipe(tmp_path, src)), "--json"])
    assert r.exit_code == 2 and "add fp8_requantize to model.allow_lossy_import to accept" in r.output, r.output
    assert not (tmp_path / "w-engine" / "artifacts" / "checkpoint").exists()
    r = CliRunner().invoke(main, ["build", str(_recipe(tmp_path, src, lossy="[fp8_requantize]")), "--json"])
    assert r.exit_code == 0, r.output
    work = tmp_path / "w-engine" / "artifacts"
    assert not (work / "calibrate").exists() and not (work / "quantize").exists()
    ckpt = next((work / "checkpoint").iterdir())
    assert json.loads((ckpt / "config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    # what validate and plan predicted before any weight was read is the quantization the conversion wrote
    recipe = load_recipe(_recipe(tmp_path, src, lossy="[fp8_requantize]"), check_rules=False)
    predicted = predicted_checkpoint_config(model_info(recipe, None), recipe)["quantization"]
    assert predicted == json.loads((ckpt / "config.json").read_text())["quantization"]
    assert any((work / "engine").iterdir())
    hf = load_hf_checkpoint(src)
    conv = load_checkpoint(ckpt)
    # FP8 requantizes fused members to their shared scale (test_modelopt_roundtrip); the KV scales and the rest
    # are the source's: with the fused weights copied back, the logits are the same
    for i, layer in enumerate(hf.layers):
        for owner, attr in (("attention", "qkv"), ("mlp", "fc"), ("mlp", "gate")):
            m, w = getattr(getattr(layer, owner)[0], attr), getattr(getattr(conv.layers[i], owner)[0], attr).weight
            parts = m.parts if hasattr(m, "parts") else [m]
            for p, piece in zip(parts, w.split([p.weight.shape[0] for p in parts])):
                p.weight.data.copy_(piece)
    assert_logits_match(conv, hf, "engine build of the fp8 export")

    r = CliRunner().invoke(main, ["build", str(_recipe(tmp_path, src, target="llmapi")), "--json"])
    assert r.exit_code == 0, r.output
    work = tmp_path / "w-llmapi" / "artifacts"
    assert not (work / "checkpoint").exists()
    out = next((work / "export").iterdir()) / "hf"
    for f in ("model.safetensors", "config.json", "hf_quant_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f


@needs("tritonclient")
@pytest.mark.slow
def test_accuracy_gate_against_the_reference_or_perplexity_alone(tmp_path, stories_dir, unified):
    """With accuracy.reference the verify stage compares the converted checkpoint with the original (a gate it can
    fail); without one it reports the perplexity alone, and a threshold is refused at validate."""
    src = unified("int4_wo")
    acc = "accuracy:\n  num_samples: 2\n  seq_len: 16\n"
    p = _recipe(tmp_path, src, acc + f"  reference: {stories_dir}\n  max_kl_divergence: 0.000001\n")
    r = CliRunner().invoke(main, ["build", str(p)])
    assert r.exit_code != 0, r.output  # int4 is not that close to the original
    assert "accuracy gate failed for quantized: KL" in r.output and "> max_kl_divergence 1e-06" in r.output, r.output
    p2 = tmp_path / "ppl"
    p2.mkdir()
    q = _recipe(p2, src, acc)
    r = CliRunner().invoke(main, ["build", str(q)])
    assert r.exit_code == 0, r.output
    ppl = json.loads(next((p2 / "w-engine" / "artifacts" / "verify").glob("*/accuracy.json")).read_text())
    assert ppl["reference"] is None and 1.0 < ppl["perplexity"] < 512
    bad = _recipe(p2, src, acc + "  max_ppl_increase_pct: 5\n")
    assert [x.key for x in _problems(bad)] == ["accuracy.max_ppl_increase_pct"]


def test_a_tp_that_would_cut_the_checkpoints_groups_is_refused(tmp_path, unified):
    ok = _recipe(tmp_path, unified("int4_wo"), "parallel:\n  tp: 2\n")  # mlp.proj (172 inputs), o_proj excluded
    assert not _problems(ok)
    bad = _recipe(tmp_path, unified("int4_wo"), "parallel:\n  tp: 4\n")  # gate/up: 172 rows / 4 = 43, odd
    msgs = [x.message for x in _problems(bad) if x.key == "parallel.tp"]
    assert msgs and "group size 64: at tp=4 mlp.fc 43 output rows per rank is odd (int4 packs row pairs)" in msgs[0], (
        msgs
    )


@pytest.mark.parametrize("algo, quant_algo", [("fp8", "FP8"), ("int4_awq", "W4A16_AWQ"), ("nvfp4", "NVFP4")])
def test_plan_sizes_a_pre_quantized_source_in_its_format(tmp_path, unified, algo, quant_algo):
    """validate / plan size a pre-quantized source's weights as the format the engine checkpoint holds, not as the
    model dtype: the predicted config carries the converted quantization (llmapi: the source's algorithm)."""
    src = unified(algo)
    for target in ("engine", "llmapi"):
        recipe = load_recipe(_recipe(tmp_path, src, target=target), check_rules=False)
        cfg = predicted_checkpoint_config(model_info(recipe, None), recipe)
        assert cfg["quantization"]["quant_algo"] == quant_algo, (target, cfg["quantization"])
        plain = {k: v for k, v in cfg.items() if k != "quantization"}
        assert weight_bytes(Shapes.of(cfg), 1, 1)[0] < weight_bytes(Shapes.of(plain), 1, 1)[0]


def test_a_group_size_the_engine_gemm_cannot_run_is_refused(tmp_path, import_base):
    """TensorRT-LLM's group-wise INT4 GEMM runs group_size 64 or 128 only (it throws at inference otherwise): a
    group-32 source is refused for the engine target naming model.source, and is fine for llmapi."""
    from trtpipe.export.unified import export_unified

    src = tmp_path / "g32"
    src.mkdir()
    export_unified(
        import_base["base"],
        import_base["hf"],
        import_base["stats"],
        src,
        algo="int4_wo",
        kv_cache="none",
        group_size=32,
        alpha=0.5,
        exclude=["*lm_head", "*mlp.proj"],
    )
    found = [(x.key, x.message) for x in _problems(_recipe(tmp_path, src))]
    assert [k for k, _ in found] == ["model.source"], found
    assert (
        "group size 32" in found[0][1]
        and "W4A16_AWQ with group_size 32: TensorRT-LLM's group-wise INT4 GEMM "
        "runs group_size 64 or 128 only (it throws at inference, after the build); use a checkpoint quantized with "
        "one of those group sizes, or target: llmapi"
        in found[0][1]
    ), found
    assert not _problems(_recipe(tmp_path, src, target="llmapi"))
