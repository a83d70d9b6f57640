"""The ``engine`` stage: TensorRT engines with trtllm-build, or the CPU twin engine where that cannot run.

Input: the quantized checkpoint (``ctx.inputs["quantize"]``) when quantization ran, else the converted one.
The build config is resolved from the recipe and the checkpoint's own config.json; any setting the builder
would change or reject fails the stage before anything runs (validation reports the same earlier). The
installed TensorRT-LLM and GPU enter the content key, so a twin is rebuilt as a real engine where they appear.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager

from trtpipe.engine import build_config as bc
from trtpipe.engine import trtllm, versions
from trtpipe.engine.ckptconfig import read_checkpoint_config
from trtpipe.engine.doctor import LOCK_FILE
from trtpipe.engine.presets import preset_dir
from trtpipe.engine.eagle_heads import with_eagle_head
from trtpipe.engine.medusa_heads import with_medusa_heads
from trtpipe.engine.twin_engine_dir import write_twin_engine
from trtpipe.errors import EngineError
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.recipe.schema import Recipe


def input_checkpoint(ctx: StageContext):
    if "quantize" in ctx.inputs:
        return ctx.inputs["quantize"]
    if "checkpoint" in ctx.inputs:
        return ctx.inputs["checkpoint"]
    raise EngineError("engine stage: no checkpoint input (the checkpoint stage did not run)")


def run_engine(ctx: StageContext) -> None:
    ckpt = input_checkpoint(ctx)
    cfg = read_checkpoint_config(ckpt)
    from trtpipe.engine.lora_build import PREFETCH_DIR, lora_build, write_prefetch

    build = bc.resolve_build(ctx.recipe, cfg, lora=lora_build(ctx.recipe))
    problems = bc.findings(build)
    if problems:
        raise EngineError("; ".join(f"{k}: {m}" for k, m in problems))
    from trtpipe.engine.planner import plan_build

    # the engine alone (runtime=False): the KV pool is a runtime setting, planned by the repo stage (kv_pool)
    plan = plan_build(ctx.recipe, cfg, build, checkpoint_dir=ckpt, runtime=False)
    ctx.info["plan"] = plan.summary()
    if not plan.fits:
        raise EngineError(plan.refusal)
    engine_cfg = bc.engine_config_json(cfg, build.config)
    ctx.info["preset"] = build.preset
    ctx.info["build_config"] = engine_cfg["build_config"]
    ctx.info["adjusted"] = [str(c) for c in build.changes]
    recipe_path = str(ctx.recipe.path) if ctx.recipe.path else "RECIPE"
    avail = trtllm.availability()
    ctx.info["lockfile"] = versions.lockfile()

    def prefetch() -> None:  # the adapters as the backend's lora_prefetch_dir (the repo stage writes its parameters)
        if build.config.lora is not None:
            ctx.info["lora_tasks"] = write_prefetch(ctx.recipe, ctx.out_dir / PREFETCH_DIR, cfg["dtype"])

    if avail.ok:
        _check_target_gpu(build.gpu, ctx.info["lockfile"]["gpus"])
        (ctx.out_dir / "build_config.json").write_text(json.dumps(engine_cfg["build_config"], indent=2) + "\n")
        with _with_heads(ctx.recipe, ckpt, ctx.out_dir.parent) as built_from:
            argv = bc.to_argv(build, built_from, ctx.out_dir)
            ctx.info["command"] = argv
            ctx.info["build"] = trtllm.run_trtllm_build(argv, ctx.out_dir, build.config.world_size, ctx.log)
        ctx.info["engine"] = "tensorrt"
        prefetch()
        _write_lock(ctx)
        return
    argv = bc.to_argv(build, "CHECKPOINT_DIR", "ENGINE_DIR")
    ctx.info["command"] = argv
    ctx.log.warning(
        "TensorRT engines need TensorRT-LLM 1.2.x on a GPU (%s); writing the CPU twin engine instead. "
        "On a GPU machine with TensorRT-LLM 1.2.x run: trtpipe build %s --from engine",
        avail.reason,
        recipe_path,
    )
    ctx.log.info("the build there will run: %s", " ".join(argv))
    with _with_heads(ctx.recipe, ckpt, ctx.out_dir.parent) as built_from:
        write_twin_engine(built_from, ctx.out_dir, engine_cfg, reason=avail.reason, recipe_path=recipe_path)
    ctx.info["engine"] = "cpu-twin"
    prefetch()
    _write_lock(ctx)


@contextmanager
def _with_heads(recipe: Recipe, ckpt, scratch):
    """The checkpoint the engine is built from: with the recipe's Medusa heads or EAGLE head converted in."""
    with with_medusa_heads(recipe, ckpt, scratch) as medusa, with_eagle_head(recipe, medusa, scratch) as built_from:
        yield built_from


def _check_target_gpu(target, gpus: list[dict]) -> None:
    """A plan only loads on the SM it was built for (docs/reference/trtllm-build.md#version-compatibility): the
    visible GPUs must be the recipe's target."""
    wrong = [g for g in gpus if g["compute_capability"] != target.compute_capability]
    if wrong:
        raise EngineError(
            f"engine.gpu: the recipe targets {target.key} (SM {target.compute_capability}) but this machine has "
            f"{wrong[0]['name']} (SM {wrong[0]['compute_capability']}); set engine.gpu to this card "
            f"(trtpipe plan --list-gpus) or build on a {target.name}"
        )


def _write_lock(ctx: StageContext) -> None:
    """The lockfile beside the engine (``trtpipe doctor ENGINE_DIR`` compares the environment against it), and
    the engine's plan."""
    from trtpipe.engine.planner import PLAN_FILE

    # the engine's own plan beside it: what the repo stage plans the KV pool from (planner.kv_pool)
    (ctx.out_dir / PLAN_FILE).write_text(json.dumps(ctx.info["plan"], indent=2) + "\n")
    keep = ("engine", "preset", "command", "build", "lockfile")
    (ctx.out_dir / LOCK_FILE).write_text(json.dumps({k: ctx.info[k] for k in keep if k in ctx.info}, indent=2) + "\n")


def toolchain_key(recipe: Recipe) -> dict:
    """The toolchain that would build (TRT-LLM version, GPUs) and the preset files' content."""
    h = hashlib.sha256()
    d = preset_dir()
    for p in sorted(d.glob("*.yaml")) if d.is_dir() else []:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    avail = trtllm.availability()
    return {
        "tensorrt_llm": avail.trtllm_version if avail.ok else None,
        "gpus": list(avail.gpus) if avail.ok else [],
        "presets": h.hexdigest()[:16],
        # an explicit engine.kv_cache.tokens_per_block wins over the preset's; a default one does not
        "tokens_per_block_written": "tokens_per_block" in recipe.engine.kv_cache.model_fields_set,
    }


def _adapter_files(recipe: Recipe) -> list:
    """The LoRA adapters' files: a retrained adapter is converted (and built in) again."""
    if recipe.target != "engine" or not recipe.lora.adapters:
        return []
    from trtpipe.export.lora import adapter_dirs

    return [d / f for d in adapter_dirs(recipe).values() for f in ("adapter_config.json", "adapter_model.safetensors")]


def _head_files(recipe: Recipe) -> list:
    """The Medusa heads' or EAGLE head's files (converted into the checkpoint the engine is built from)."""
    if recipe.target != "engine" or recipe.speculative.decoding_type not in ("medusa", "eagle"):
        return []
    from trtpipe.recipe.speculative import draft_dir

    if recipe.speculative.decoding_type == "eagle":
        from trtpipe.recipe.eagle import HEAD_FILES
    else:
        from trtpipe.recipe.medusa import HEAD_FILES

    d = draft_dir(recipe)
    return [p for p in (d / f for f in ("config.json", *HEAD_FILES)) if p.is_file()] if d is not None else []


ENGINE_STAGE = Stage(
    name="engine",
    # What changes the engine; the runtime-only KV settings (memory fraction, reuse, ...) and workers do not.
    sections=(
        "engine.gpu",
        "engine.max_batch_size",
        "engine.max_input_len",
        "engine.max_seq_len",
        "engine.max_num_tokens",
        "engine.max_beam_width",
        "engine.plugins",
        "engine.kv_cache.tokens_per_block",
        "parallel",
        "speculative",  # trtllm-build --speculative_decoding_mode / --max_draft_len
        # trtllm-build --lora_*, and the adapters converted into lora_prefetch/ (the cache bounds max_loras /
        # max_cpu_loras are the repo stage's: they size lora_cache_*, never the engine)
        "lora.adapters",
        "lora.max_lora_rank",
    ),
    inputs=("checkpoint", "quantize"),
    run=run_engine,
    files=lambda recipe: _adapter_files(recipe) + _head_files(recipe),
    extra_key=toolchain_key,
    unkeyed=(
        # trtllm-build --workers: how many engines build at once, the same engines either way (the lock file
        # records the command that built them)
        "engine.workers",
        # which shape limits the recipe wrote: decides only whether bc.findings refuses a limit trtllm-build would
        # change (validation refuses the same before every build), never a value written
        "engine.model_fields_set",
    ),
    enabled=lambda recipe: recipe.target == "engine",
    description="TensorRT engines (trtllm-build), or the CPU twin engine without TensorRT-LLM",
)
