"""The ``draft_engine`` stage: the draft model of ``speculative.decoding_type: draft_tokens_external`` as an engine of
its own, served as ``tensorrt_llm_draft`` beside the target (upstream's two-model form,
``examples/draft_target_model/README.md@567239fc``: the draft converted and built like the target, the target alone
with ``--speculative_decoding_mode draft_tokens_external --max_draft_len N``).

The draft (``speculative.speculative_model``) is converted as the checkpoint stage converts the target (the
recipe's dtype and tp x pp; a pre-quantized draft, e.g. an INT4 AWQ export, in the TensorRT-LLM layout of its own
format, :mod:`trtpipe.quant.imported`) and built with the target's limits and plugins and no speculative mode:
TensorRT engines where TensorRT-LLM runs, else the CPU twin engine. With ``speculative.draft_quantization: recipe``
(the default) and a recipe that quantizes, or an algorithm named there (e.g. ``int4_awq`` for a draft of an
unquantized target: the recipe's section with that ``algo``; a mapping: the section with its keys replaced, the
draft's own group size, excludes and calibration), the converted draft is calibrated on that section's calibration data and
quantized by the quantize stage's own functions (:func:`trtpipe.stages.quant.run_calibration`,
:func:`~trtpipe.stages.quant.run_quantization`) before it is built; the rules are :mod:`trtpipe.quant.draft_rules`.

Artifact: ``checkpoint/`` (the converted draft), ``calibrate/`` and ``quantized/`` (when the draft is quantized)
and ``engine/`` (what the repo stage serves).
"""

from __future__ import annotations

from pathlib import Path

from trtpipe.engine import build_config as bc
from trtpipe.engine import trtllm
from trtpipe.engine.ckptconfig import read_checkpoint_config
from trtpipe.engine.twin_engine_dir import write_twin_engine
from trtpipe.errors import EngineError, TrtpipeError
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.quant.draft_rules import builds_draft, draft_quant_recipe, mode_label, quantizes_draft
from trtpipe.recipe.schema import QuantizationSection, Recipe
from trtpipe.stages.checkpoint import WEIGHT_PATTERNS
from trtpipe.stages.engine import toolchain_key

ENGINE_DIR = "engine"


def enabled(recipe: Recipe) -> bool:
    return builds_draft(recipe)


def draft_files(recipe: Recipe) -> list[Path]:
    """The draft's weight, config and tokenizer files (an hf:// draft is keyed by its URI, in ``speculative``)."""
    from trtpipe.checkpoint.convert import TOKENIZER_FILES

    src = recipe.speculative.speculative_model
    if not enabled(recipe) or src is None or src.startswith("hf://"):
        return []
    path = recipe.resolve(src)
    if not path.is_dir():
        return []
    files = {p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern)}
    return sorted(files | {path / n for n in TOKENIZER_FILES if (path / n).is_file()})


def draft_build_recipe(recipe: Recipe) -> Recipe:
    """The recipe the draft is built from: the target's limits and plugins, no speculative mode (a draft engine is
    built without ``--speculative_decoding_mode``, as upstream's README builds it), the recipe's quantization only
    when the draft was quantized with it (the build reads the format from the checkpoint's config either way)."""
    spec = recipe.speculative.model_copy(update={"decoding_type": "none"})
    dq = draft_quant_recipe(recipe)
    quant = dq.quantization if dq is not None else QuantizationSection()
    return recipe.model_copy(update={"speculative": spec, "quantization": quant})


def _draft_key(recipe: Recipe) -> dict:
    """The toolchain, and, when the draft is calibrated here, the calibration data's version (built-in sets)."""
    from trtpipe.quant import slices
    from trtpipe.stages.quant import calibration_specs

    key = toolchain_key(recipe)
    dq = draft_quant_recipe(recipe)
    if dq is not None:  # the draft's own calibration settings when draft_quantization is a mapping
        key["calibration_data"] = slices.data_version(calibration_specs(dq))
    return key


def _key_files(recipe: Recipe) -> list[Path]:
    """The draft's files and, when the draft is calibrated here, the calibration data files."""
    from trtpipe.stages.quant import calibration_files, needs_calibration

    files = draft_files(recipe)
    dq = draft_quant_recipe(recipe)
    if dq is not None and needs_calibration(dq):
        files += calibration_files(dq)
    return files


def quantize_draft(ctx: StageContext, src: Path, ckpt: Path) -> Path:
    """The converted draft ``ckpt`` calibrated and quantized with the recipe's ``quantization`` section (its
    ``algo`` replaced when ``draft_quantization`` names one), by the quantize stage's code; returns the quantized checkpoint. A failure is one line naming the key and the draft."""
    from trtpipe.stages.quant import needs_calibration, run_calibration, run_quantization

    recipe = draft_quant_recipe(ctx.recipe)
    q, mode = recipe.quantization, mode_label(recipe)
    stats = None
    try:
        if needs_calibration(recipe):
            stats = ctx.out_dir / "calibrate"
            stats.mkdir()
            ctx.log.info("calibrating the draft on %s", q.calibration.dataset)
            ctx.info["calibration"] = run_calibration(recipe, ckpt, stats)
        out = ctx.out_dir / "quantized"
        out.mkdir()
        ctx.log.info("quantizing the draft: algo=%s kv_cache=%s", q.algo, q.kv_cache)
        ctx.info["quantization"] = run_quantization(recipe, ckpt, stats, out)["quantization"]
    except (TrtpipeError, ValueError, RuntimeError) as exc:
        raise EngineError(
            f"speculative.draft_quantization: {mode}: quantizing the draft {src} with algo {q.algo} / "
            f"kv_cache {q.kv_cache}: {' '.join(str(exc).split())}"
        ) from exc
    return out


def run(ctx: StageContext) -> None:
    from trtpipe.checkpoint.convert import convert
    from trtpipe.quant.imported.detect import detect
    from trtpipe.quant.imported.trtllm import ImportedLinears
    from trtpipe.recipe.speculative import draft_dir

    recipe, par = ctx.recipe, ctx.recipe.parallel
    src = draft_dir(recipe)
    if src is None or not src.is_dir():
        raise EngineError(f"speculative.speculative_model: '{recipe.speculative.speculative_model}' is not a directory")
    fmt = detect(src)
    importer = None
    if fmt is not None:
        ctx.info["imported"] = fmt.describe()
        allowed = tuple(recipe.model.allow_lossy_import)
        importer = lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), allowed)  # noqa: E731
    ckpt = ctx.out_dir / "checkpoint"
    ctx.log.info("converting the draft %s at tp=%d pp=%d dtype=%s", src, par.tp, par.pp, recipe.model.dtype)
    convert(
        src,
        ckpt,
        tp=par.tp,
        pp=par.pp,
        dtype=recipe.model.dtype,
        allow_pickle=recipe.model.allow_pickle,
        overwrite=True,
        importer=importer,
    )
    if quantizes_draft(recipe):
        ckpt = quantize_draft(ctx, src, ckpt)
    cfg = read_checkpoint_config(ckpt)
    build = bc.resolve_build(draft_build_recipe(recipe), cfg)
    problems = bc.findings(build)
    if problems:
        own = isinstance(recipe.speculative.draft_quantization, dict)  # the draft's own section: name its keys
        name = lambda k: "speculative.draft_" + k if own and k.startswith("quantization.") else k  # noqa: E731
        raise EngineError("; ".join(f"draft engine: {name(k)}: {m}" for k, m in problems))
    engine_cfg = bc.engine_config_json(cfg, build.config)
    out = ctx.out_dir / ENGINE_DIR
    avail = trtllm.availability()
    if avail.ok:
        argv = bc.to_argv(build, ckpt, out)
        ctx.info["command"] = argv
        ctx.info["build"] = trtllm.run_trtllm_build(argv, out, build.config.world_size, ctx.log)
        ctx.info["engine"] = "tensorrt"
        return
    ctx.info["command"] = bc.to_argv(build, "DRAFT_CHECKPOINT_DIR", "DRAFT_ENGINE_DIR")
    write_twin_engine(ckpt, out, engine_cfg, reason=avail.reason)
    ctx.info["engine"] = "cpu-twin"


DRAFT_ENGINE_STAGE = Stage(
    name="draft_engine",
    # the draft's conversion (model.dtype, allow_pickle, allow_lossy_import; parallel), its quantization
    # (draft_quantization: recipe) and the engine's limits
    sections=("model", "parallel", "engine", "speculative", "quantization"),
    inputs=(),
    run=run,
    files=_key_files,
    extra_key=_draft_key,
    enabled=enabled,
    description="the draft model's engine (speculative draft_tokens_external: tensorrt_llm_draft)",
)
