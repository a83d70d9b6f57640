"""Library entry points behind ``trtpipe plan`` and ``trtpipe engine``, and their text rendering.

The model facts come from, in order: a built checkpoint (``checkpoint=``; its config.json and real weight
bytes), a Hugging Face ``config.json`` given explicitly (``model_config=``, for models not on this disk, e.g.
``recipes/configs/<model>/config.json``), or the recipe's model directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from trtpipe.engine import build_config as bc
from trtpipe.engine.ckptconfig import predicted_checkpoint_config, read_checkpoint_config
from trtpipe.formats.gpus import CATALOG, get_gpu
from trtpipe.engine.planner import GiB, Plan, plan_build
from trtpipe.errors import EngineError, Problem, RecipeError
from trtpipe.models.dims import ModelDims, parse_hf_config
from trtpipe.recipe.rules import load_model_info
from trtpipe.recipe.schema import Recipe
from trtpipe.app.validation import RULES, load_recipe
from trtpipe.jsonfile import load_json

_SOURCE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Resolved:
    recipe: Recipe
    checkpoint_config: dict
    build: bc.EngineBuild
    plan: Plan
    checkpoint: Optional[Path]


def model_info(recipe: Recipe, model_config: Optional[Path]) -> ModelDims:
    """The model facts ``plan`` and ``predict`` work from: an explicit ``config.json`` (``--model-config``, for a
    model not on this disk) or the recipe's model; an :class:`EngineError` that says which flag helps otherwise."""
    if model_config is not None:
        try:
            return parse_hf_config(load_json(Path(model_config), EngineError), str(model_config))
        except (OSError, json.JSONDecodeError) as exc:
            raise EngineError(f"{model_config}: cannot read config.json: {exc}") from None
    info, problems = load_model_info(recipe)
    if info is None:
        msg = problems[0][1] if problems else "model config not found"
        raise EngineError(f"model.source: {msg} (pass --model-config PATH/config.json for a model not on this disk)")
    return info


def _check(recipe: Recipe, info: ModelDims) -> None:
    """Every validation rule except the planner's own refusal (plan prints that itself)."""
    name = str(recipe.path) if recipe.path else "<recipe>"
    problems = []
    for fn in RULES:
        for key, message in fn(recipe, info):
            if not message.startswith("does not fit"):
                problems.append(Problem(name, *recipe.position(key), key, message))
    if problems:
        raise RecipeError(problems)


def built_checkpoint(recipe: Recipe) -> Optional[Path]:
    """The engine stage's input artifact if this recipe already built it (quantize if enabled, else checkpoint)."""
    from trtpipe.pipeline.cache import ArtifactStore
    from trtpipe.pipeline.runner import plan_build as plan_stages
    from trtpipe.app.stage_table import STAGES
    from trtpipe.errors import TrtpipeError

    try:
        plans = plan_stages(recipe, STAGES)
    except (TrtpipeError, OSError):  # e.g. a model directory that is not on this disk
        return None
    by_name = {p.name: p for p in plans}
    for name in ("quantize", "checkpoint"):
        p = by_name.get(name)
        if p is None or p.disabled:
            continue
        return ArtifactStore(recipe.work_path).path(name, p.key) if p.cached and p.key else None
    return None


def resolve(
    recipe_path: Path,
    overrides: Iterable[str] = (),
    gpu: Optional[str] = None,
    model_config: Optional[Path] = None,
    checkpoint: Optional[Path] = None,
) -> Resolved:
    """Load the recipe, predict (or read) the checkpoint config, resolve the build and plan memory."""
    overrides = list(overrides) + ([f"engine.gpu={gpu}"] if gpu else [])
    recipe = load_recipe(recipe_path, overrides, check_rules=False)
    get_gpu(recipe.engine.gpu)
    if checkpoint is None and model_config is None and recipe.target == "engine":
        checkpoint = built_checkpoint(recipe)  # llmapi: weights predicted from the unified HF format instead
    if checkpoint is not None:
        cfg = read_checkpoint_config(checkpoint)
        source_bytes = 2
    else:
        info = model_info(recipe, model_config)
        _check(recipe, info)
        cfg = predicted_checkpoint_config(info, recipe)
        source_bytes = _SOURCE_BYTES.get(info.torch_dtype, 2)
    build = bc.resolve_build(recipe, cfg)
    plan = plan_build(recipe, cfg, build, checkpoint_dir=checkpoint, source_dtype_bytes=source_bytes)
    return Resolved(recipe, cfg, build, plan, checkpoint)


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{int(n)} B"


def render_plan(r: Resolved) -> str:
    p, b = r.plan, r.build
    cfg = r.checkpoint_config
    qa = (cfg.get("quantization") or {}).get("quant_algo")
    lines = [
        f"recipe {r.recipe.name}: {cfg['architecture']} {cfg['dtype']}, quant_algo {qa}, KV cache {p.kv_dtype}",
        f"target: {p.tp * p.pp} x {p.gpu.name} ({p.gpu.key}, {_size(p.gpu.memory_bytes)}, SM {p.gpu.compute_capability}, "
        f"{p.gpu.bandwidth_gbs} GB/s), tp={p.tp}{' attention-DP' if p.attention_dp else ''} pp={p.pp}, preset {b.preset}{' (auto)' if b.preset_is_auto else ''}",
        *(
            [
                f"target llmapi: TensorRT-LLM PyTorch backend (no engine); weights as the unified HF checkpoint "
                f"({qa}), KV pool = kv_cache_config.free_gpu_memory_fraction of what is left"
            ]
            if r.recipe.target == "llmapi"
            else []
        ),
        f"KV bytes/token: {p.kv_bytes_per_token_model} for the whole model; per GPU "
        + ", ".join(f"{int(x.kv_bytes_per_token)} (pp rank {x.pp_rank}, {x.layers} layers)" for x in p.ranks),
    ]
    for x in p.ranks:
        lines.append(
            f"pp rank {x.pp_rank}: weights {_size(x.weight_bytes)} (from {p.weights_from}) + activations ~{_size(x.activation_bytes)} "
            f"+ runtime reserve ~{_size(x.reserve_bytes)}; free {_size(max(x.free_bytes, 0))} -> KV pool {_size(x.kv_pool_bytes)} "
            f"= {x.kv_tokens} tokens = {x.kv_blocks} blocks"
        )
    d = p.draft
    if d is not None:
        lines.append(
            f"speculative {r.recipe.speculative.decoding_type}: draft weights {_size(d.weight_bytes)} per GPU "
            f"({d.counted_from}, included above), draft KV {int(d.kv_bytes_per_token)} bytes/token per GPU "
            f"(included above), sequences +{d.extra_positions} positions"
        )
    e = p.experts
    if e is not None:
        lines.append(
            f"experts: {e.per_rank} of {e.experts} per GPU (moe_ep {e.moe_ep} x moe_tp {e.moe_tp}; {e.width} of each "
            f"expert's rows): {_size(e.layer_bytes)} per layer, {_size(e.gpu_bytes)} per GPU of the weights above"
        )
    ranks = p.tp if p.attention_dp else 1  # attention DP: a pool and a max_batch_size per GPU
    per_gpu = f" on each of {p.tp} GPUs, for its own requests" if p.attention_dp else ""
    lines.append(
        f"KV capacity: {p.kv_tokens} tokens ({p.kv_blocks} blocks of {p.tokens_per_block}){per_gpu}; one sequence of "
        f"max_seq_len {p.max_seq_len} needs {p.blocks_per_sequence} blocks -> {p.concurrent_sequences} concurrent "
        f"full-length sequences (max_batch_size {p.max_batch_size}{' per GPU' if ranks > 1 else ''}"
        f"{', KV-limited' if p.concurrent_sequences < ranks * p.max_batch_size else ''})"
    )
    lines.append("host memory (estimates): " + ", ".join(f"{k} {_size(v)}" for k, v in p.host_bytes.items()))
    from trtpipe.export.lora import cache_line

    lora = cache_line(r.recipe, 4 if cfg["dtype"] == "float32" else 2, p.tp)
    if lora:
        lines.append(lora)
    for ch in b.changes:
        lines.append(f"adjusted: {ch}")
    lines.append("fits" if p.fits else f"REFUSED: {p.refusal}")
    return "\n".join(lines)


def plan_json(r: Resolved) -> dict:
    return {
        "recipe": r.recipe.name,
        "preset": r.build.preset,
        **r.plan.summary(),
        "adjusted": [str(c) for c in r.build.changes],
    }


def render_build(r: Resolved) -> str:
    ckpt = str(r.checkpoint) if r.checkpoint else "CHECKPOINT_DIR"
    argv = bc.to_argv(r.build, ckpt, "ENGINE_DIR")
    lines = [f"# preset {r.build.preset}{' (auto)' if r.build.preset_is_auto else ''}"]
    lines += [f"# adjusted: {c}" for c in r.build.changes]
    lines.append(" ".join(argv))
    lines.append("# equivalent build_config JSON (trtllm-build --build_config, and config.json's build_config):")
    lines.append(json.dumps(bc.to_json(r.build.config), indent=2))
    return "\n".join(lines)


def gpu_table() -> str:
    return "\n".join(
        f"{g.key:20s} {g.name:32s} {g.memory_mib / 1024:7.1f} GiB{'*' if g.nominal else ' '} "
        f"SM {g.compute_capability:5s} {g.bandwidth_gbs:5d} GB/s  {g.arch}"
        for g in CATALOG
    )


def build_engine(r: Resolved, out_dir: Path, log) -> dict:
    """Build the engine (or the CPU twin) of ``r.checkpoint`` into an empty ``out_dir``, as the stage does."""
    import logging
    import shutil
    import tempfile

    from trtpipe.stages.engine import run_engine
    from trtpipe.pipeline.stage import StageContext

    if r.checkpoint is None:
        raise EngineError("trtpipe engine --out needs --checkpoint DIR (a TensorRT-LLM checkpoint)")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise EngineError(f"{out_dir}: output directory is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".engine-", dir=out_dir.parent))  # same filesystem: the rename is atomic
    ctx = StageContext(
        recipe=r.recipe,
        out_dir=tmp,
        inputs={"checkpoint": r.checkpoint},
        log=log or logging.getLogger("trtpipe.engine"),
        work_dir=tmp.parent,
        quiet=True,
    )
    try:
        run_engine(ctx)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return ctx.info


def planned_weight_bytes(recipe_path: Path, overrides) -> int:
    """Largest weight bytes on one GPU, as ``trtpipe plan`` computes them (built checkpoint, else config.json):
    what ``deploy`` sizes its startup probes and caches by."""
    return int(resolve(recipe_path, overrides).plan.summary()["weight_bytes_per_gpu"])
