"""The CPU twin engine and the engine stage on this machine (no TensorRT-LLM, no GPU)."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
from click.testing import CliRunner

from engine_helpers import STORIES, write_checkpoint
from trtpipe.cli import main
from trtpipe.engine import build_config as bc
from trtpipe.engine.ckptconfig import read_checkpoint_config
from trtpipe.stages.engine import ENGINE_STAGE, run_engine
from trtpipe.engine.trtllm import availability
from trtpipe.engine.twin_engine_dir import TWIN_FILE, write_twin_engine
from trtpipe.errors import EngineError
from trtpipe.pipeline.versions import PACKAGES, package_version
from trtpipe.pipeline.stage import StageContext
from trtpipe.app.validation import load_recipe

TINY = {
    "architecture": "LlamaForCausalLM",
    "dtype": "float16",
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_size": 8,
    "intermediate_size": 172,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1, "rank": 0},
    "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
}


@pytest.fixture(autouse=True)
def _twin_on_any_machine(request, tmp_path_factory, monkeypatch):
    """These tests are about the CPU twin: with neither trtllm-build nor nvidia-smi on PATH the engine stage writes
    it on the GPU host too (the gpu-marked test keeps the real PATH)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty-path")))


@pytest.fixture(scope="module")
def stories_tp2(tmp_path_factory):
    """stories260k converted by the real converter at tp=2, float16."""
    from trtpipe.checkpoint.convert import convert

    return convert(STORIES, tmp_path_factory.mktemp("ckpt") / "tp2", tp=2, dtype="float16")


def recipe_file(tmp_path, extra: str = "", tp: int = 2):
    p = tmp_path / "stories.yaml"
    p.write_text(
        f"name: stories\nmodel:\n  source: {STORIES}\n  dtype: float16\nparallel:\n  tp: {tp}\n"
        f"engine:\n  max_batch_size: 8\n  max_input_len: 256\n  max_num_tokens: 2048\n  workers: 2\n"
        f"triton:\n  max_batch_size: 8\n{extra}"
    )
    return p


def test_availability_says_why_without_trtllm_build_and_gpus():
    """Neither trtllm-build nor nvidia-smi on PATH: no engine can be built, and the reason names what is missing,
    whether TensorRT-LLM is installed (the GPU host) or not (this machine)."""
    a = availability()
    assert not a.ok and a.gpus == ()
    assert re.fullmatch(
        r"TensorRT-LLM is not installed and no CUDA GPU is visible"
        r"|TensorRT-LLM \S+ is installed but trtllm-build is not on PATH"
        r"|TensorRT-LLM \S+ has no trtllm-build TensorRT-engine path \(needs 1\.0-1\.2\.x\)",
        a.reason,
    )


def test_write_twin_engine_layout(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY, world_size=2)
    build_cfg = {"max_batch_size": 8, "plugin_config": {"tokens_per_block": 32}}
    out = write_twin_engine(ckpt, tmp_path / "engine", build_cfg, recipe_path="r.yaml")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "config.json", TWIN_FILE]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["version"] == "1.2.1" and cfg["build_config"] == build_cfg
    assert cfg["pretrained_config"]["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}  # rank stripped
    twin = json.loads((out / TWIN_FILE).read_text())
    assert twin["kind"] == "cpu-twin" and twin["command"] == "trtpipe build r.yaml --from engine" and twin["reason"]
    copied = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert copied == sorted(p.name for p in ckpt.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "rank1.safetensors"} <= set(copied)
    for name in copied:  # hardlinked: the same inode, no bytes copied
        assert os.stat(out / "checkpoint" / name).st_ino == os.stat(ckpt / name).st_ino
    assert not list(out.glob("rank*.engine"))


def test_write_twin_engine_refuses_bad_input(tmp_path):
    with pytest.raises(EngineError, match="no config.json"):
        write_twin_engine(tmp_path, tmp_path / "e1", {})
    ckpt = write_checkpoint(tmp_path / "ckpt", TINY, world_size=1)  # config says world_size 2
    with pytest.raises(EngineError, match="1 rank files for world_size 2"):
        write_twin_engine(ckpt, tmp_path / "e2", {})
    assert not (tmp_path / "e2").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    ok = write_checkpoint(tmp_path / "ok", {**TINY, "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}})
    with pytest.raises(EngineError, match="not empty"):
        write_twin_engine(ok, busy, {})


def _ctx(tmp_path, recipe, inputs):
    out = tmp_path / "out"
    out.mkdir()
    return StageContext(
        recipe=recipe, out_dir=out, inputs=inputs, log=logging.getLogger("test.engine"), work_dir=tmp_path, quiet=True
    )


def test_engine_stage_writes_the_twin_of_a_converted_checkpoint(tmp_path, stories_tp2, caplog):
    recipe = load_recipe(recipe_file(tmp_path))
    ctx = _ctx(tmp_path, recipe, {"checkpoint": stories_tp2})
    with caplog.at_level(logging.INFO, logger="test.engine"):
        run_engine(ctx)
    text = caplog.text
    assert "TensorRT engines need TensorRT-LLM 1.2.x on a GPU" in text
    assert f"trtpipe build {recipe.path} --from engine" in text
    out = ctx.out_dir
    cfg = json.loads((out / "config.json").read_text())
    ckpt_cfg = read_checkpoint_config(stories_tp2)
    build = bc.resolve_build(recipe, ckpt_cfg)
    assert cfg["build_config"] == bc.to_json(build.config)
    assert cfg["build_config"]["max_seq_len"] == 512  # deduced from max_position_embeddings
    assert cfg["pretrained_config"]["num_key_value_heads"] == 4 and cfg["pretrained_config"]["mapping"]["tp_size"] == 2
    assert "rank" not in cfg["pretrained_config"]["mapping"]
    assert sorted(p.name for p in (out / "checkpoint").glob("rank*.safetensors")) == [
        "rank0.safetensors",
        "rank1.safetensors",
    ]
    assert (out / "checkpoint" / "tokenizer.json").is_file()
    lock = json.loads((out / "trtpipe_lock.json").read_text())
    assert lock["engine"] == "cpu-twin" and lock["lockfile"]["gpus"] == []
    assert lock["lockfile"]["tensorrt_llm"] == package_version(*PACKAGES["tensorrt_llm"])  # None here
    assert ctx.info["plan"]["fits"] and ctx.info["plan"]["weights_from"] == "checkpoint"
    assert ctx.info["command"][:3] == ["trtllm-build", "--checkpoint_dir", "CHECKPOINT_DIR"]


def test_engine_stage_prefers_the_quantized_checkpoint(tmp_path, stories_tp2):
    recipe = load_recipe(recipe_file(tmp_path))
    ctx = _ctx(tmp_path, recipe, {"checkpoint": tmp_path / "does-not-exist", "quantize": stories_tp2})
    run_engine(ctx)
    assert (ctx.out_dir / "checkpoint" / "rank1.safetensors").is_file()
    assert ENGINE_STAGE.name == "engine" and ENGINE_STAGE.inputs == ("checkpoint", "quantize")
    key = ENGINE_STAGE.extra_key(recipe)
    assert key["tensorrt_llm"] is None and len(key["presets"]) == 16


def test_engine_stage_refuses_what_the_builder_would_change(tmp_path, stories_tp2):
    recipe = load_recipe(recipe_file(tmp_path, tp=2), check_rules=False)
    recipe.engine.plugins.overrides = {"user_buffer": True}  # without reduce_fusion: the builder turns it off
    ctx = _ctx(tmp_path, recipe, {"checkpoint": stories_tp2})
    with pytest.raises(EngineError, match="user_buffer needs reduce_fusion"):
        run_engine(ctx)
    assert list(ctx.out_dir.iterdir()) == []


def test_cli_engine_prints_and_builds(tmp_path, stories_tp2):
    path = recipe_file(tmp_path)
    res = CliRunner().invoke(main, ["engine", str(path), "--checkpoint", str(stories_tp2)])
    assert res.exit_code == 0, res.output
    assert "trtllm-build --checkpoint_dir" in res.output and '"max_seq_len": 512' in res.output
    out = tmp_path / "engine"
    res = CliRunner().invoke(main, ["engine", str(path), "--checkpoint", str(stories_tp2), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "cpu-twin engine" in res.output and (out / TWIN_FILE).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".engine-")]
    res = CliRunner().invoke(main, ["engine", str(path), "--checkpoint", str(stories_tp2), "--out", str(out)])
    assert res.exit_code == 1 and "not empty" in res.output


def test_predicted_weight_bytes_equal_the_converted_checkpoint(tmp_path, stories_tp2):
    """The planner's config.json arithmetic against the bytes the real converter wrote (tp=2, float16)."""
    from trtpipe.engine import planner
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.models.dims import read_hf_config

    recipe = load_recipe(recipe_file(tmp_path))
    predicted = predicted_checkpoint_config(read_hf_config(STORIES), recipe)
    real = read_checkpoint_config(stories_tp2)
    s = planner.Shapes.of(predicted)
    assert planner.weight_bytes(s, 2, 1) == planner.checkpoint_weight_bytes(stories_tp2, 2, 1)
    build = bc.resolve_build(recipe, real)
    assert bc.to_json(build.config) == bc.to_json(bc.resolve_build(recipe, predicted).config)


@pytest.mark.gpu
@pytest.mark.slow
def test_real_trtllm_build_on_a_gpu(tmp_path, stories_tp2):
    """Where TensorRT-LLM 1.0-1.2 and GPUs are present: real rank engines, the builder's config.json, the lockfile."""
    avail = availability()
    if not avail.ok:
        pytest.skip(f"needs TensorRT-LLM 1.2.x on a GPU: {avail.reason}")
    if len(avail.gpus) < 2:
        pytest.skip("the tp=2 stories checkpoint needs 2 GPUs")
    from trtpipe.formats.gpus import gpu_from_device_name

    card = gpu_from_device_name(avail.gpus[0])
    if card is None:
        pytest.skip(f"{avail.gpus[0]} is not in the GPU catalog")
    recipe = load_recipe(recipe_file(tmp_path, extra=""), [f"engine.gpu={card.key}"], check_rules=False)
    ctx = _ctx(tmp_path, recipe, {"checkpoint": stories_tp2})
    run_engine(ctx)
    assert (ctx.out_dir / "rank0.engine").is_file() and (ctx.out_dir / "rank1.engine").is_file()
    cfg = json.loads((ctx.out_dir / "config.json").read_text())
    assert cfg["version"] == avail.trtllm_version
    assert cfg["build_config"]["max_num_tokens"] == ctx.info["build_config"]["max_num_tokens"]
    assert cfg["build_config"]["plugin_config"]["use_paged_context_fmha"] is True
    assert ctx.info["build"]["seconds"] > 0 and ctx.info["lockfile"]["gpus"]


def test_real_build_refuses_a_gpu_other_than_the_target():
    from trtpipe.formats.gpus import get_gpu
    from trtpipe.stages.engine import _check_target_gpu

    _check_target_gpu(get_gpu("h100-sxm-80gb"), [{"name": "NVIDIA H200", "compute_capability": "9.0"}])
    with pytest.raises(
        EngineError, match=r"targets h100-sxm-80gb \(SM 9.0\) but this machine has NVIDIA A10G \(SM 8.6\)"
    ):
        _check_target_gpu(get_gpu("h100-sxm-80gb"), [{"name": "NVIDIA A10G", "compute_capability": "8.6"}])


def test_engine_stage_builds_medusa_from_the_checkpoint_with_the_heads(tmp_path, stories_tp2):
    """speculative.decoding_type medusa: the twin engine's checkpoint is upstream's MedusaForCausalLM checkpoint (the
    heads split over tp), the command is trtllm-build's medusa mode, the heads' files are in the stage's key, and
    nothing is left beside the engine."""
    from safetensors.torch import load_file

    from trtpipe.models.synthetic_heads import make_medusa_heads

    heads = make_medusa_heads(STORIES, tmp_path / "heads", num_heads=4, seed=1)
    extra = f"speculative:\n  decoding_type: medusa\n  speculative_model: {heads}\n  max_draft_len: 2\n"
    recipe = load_recipe(recipe_file(tmp_path, extra, tp=2).rename(tmp_path / "medusa.yaml"))
    ctx = _ctx(tmp_path, recipe, {"checkpoint": stories_tp2})
    run_engine(ctx)
    cfg = json.loads((ctx.out_dir / "checkpoint" / "config.json").read_text())
    assert (cfg["architecture"], cfg["num_medusa_heads"], cfg["max_draft_len"]) == ("MedusaForCausalLM", 4, 2)
    r1 = load_file(str(ctx.out_dir / "checkpoint" / "rank1.safetensors"))
    src = load_file(str(heads / "medusa_lm_head.safetensors"))
    assert r1["medusa_heads.3.lm_head.weight"].shape == (256, 64)  # vocab 512 split over tp 2
    assert (r1["medusa_heads.3.lm_head.weight"].float() == src["3.1.weight"][256:].half().float()).all()
    argv = ctx.info["command"]
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "medusa", "--max_draft_len", "2"]
    assert {p.name for p in ENGINE_STAGE.files(recipe)} == {"config.json", "medusa_lm_head.safetensors"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".medusa")]


def test_engine_stage_builds_eagle_from_the_checkpoint_with_the_head(tmp_path, stories_tp2):
    """speculative.decoding_type eagle: the twin engine's checkpoint is upstream's EagleForCausalLM checkpoint (the
    head split over tp, one EagleNet per draft of the chain), the command is trtllm-build's eagle mode, the head's
    files are in the stage's key, and nothing is left beside the engine."""
    import torch
    from safetensors.torch import load_file

    from trtpipe.models.synthetic_heads import make_eagle1_head

    head = make_eagle1_head(STORIES, tmp_path / "head", seed=1)
    extra = f"speculative:\n  decoding_type: eagle\n  speculative_model: {head}\n  max_draft_len: 2\n"
    recipe = load_recipe(recipe_file(tmp_path, extra, tp=2).rename(tmp_path / "eagle.yaml"))
    ctx = _ctx(tmp_path, recipe, {"checkpoint": stories_tp2})
    run_engine(ctx)
    cfg = json.loads((ctx.out_dir / "checkpoint" / "config.json").read_text())
    keys = ("architecture", "num_eagle_layers", "max_draft_len", "max_non_leaves_per_layer")
    assert tuple(cfg[k] for k in keys) == ("EagleForCausalLM", 2, 2, 1)
    r1 = load_file(str(ctx.out_dir / "checkpoint" / "rank1.safetensors"))
    src = torch.load(head / "pytorch_model.bin", weights_only=True)
    assert r1["eagle_nets.1.drafter.fc.weight"].shape == (32, 128)  # [H / tp, 2H] of the 64-wide model
    assert torch.equal(r1["eagle_nets.1.drafter.fc.bias"].float(), src["fc.bias"][32:].half().float())
    argv = ctx.info["command"]
    i = argv.index("--speculative_decoding_mode")
    assert argv[i : i + 4] == ["--speculative_decoding_mode", "eagle", "--max_draft_len", "2"]
    assert {p.name for p in ENGINE_STAGE.files(recipe)} == {"config.json", "pytorch_model.bin"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".eagle")]
