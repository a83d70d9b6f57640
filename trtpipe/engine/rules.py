"""Engine rules for ``trtpipe validate``: what trtllm-build would silently change or reject, and the planner's refusal.

Fast by construction: only config.json is read (through the ``ModelDims`` the validator passes in), the
build config is predicted from it, and the planner does arithmetic only.
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.engine import build_config as bc
from trtpipe.engine.ckptconfig import predicted_checkpoint_config
from trtpipe.engine.enforce import Target, rejections, tensor_core_rejections
from trtpipe.formats.gpus import get_gpu
from trtpipe.engine.presets import FIELDS, get_preset, normalize
from trtpipe.errors import CheckpointError, EngineError
from trtpipe.models.dims import ModelDims
from trtpipe.quant.imported.rules import family_refuses, source_format
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe

IFB_STRATEGIES = ("inflight_fused_batching", "inflight_batching")


def _as_finding(exc: EngineError, default_key: str) -> Finding:
    """Split 'engine.x.y: message' into (key, message); the recipe position comes from the key."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    return (head, rest) if sep and head.startswith(("engine.", "quantization.", "parallel.")) else (default_key, text)


def _names(recipe: Recipe) -> Iterable[Finding]:
    """GPU, preset and override names and values: checkable without the model."""
    e = recipe.engine
    try:
        get_gpu(e.gpu)
    except EngineError as exc:
        yield _as_finding(exc, "engine.gpu")
    if e.plugins.preset != "auto":
        try:
            get_preset(e.plugins.preset)
        except EngineError as exc:
            yield _as_finding(exc, "engine.plugins.preset")
    for key, value in e.plugins.overrides.items():
        try:
            normalize(key, value, f"engine.plugins.overrides.{key}")
        except EngineError as exc:
            yield _as_finding(exc, f"engine.plugins.overrides.{key}")
    tpb = e.plugins.overrides.get("tokens_per_block")
    if tpb is not None and "tokens_per_block" in e.kv_cache.model_fields_set and tpb != e.kv_cache.tokens_per_block:
        yield (
            "engine.plugins.overrides.tokens_per_block",
            (
                f"{tpb} conflicts with engine.kv_cache.tokens_per_block {e.kv_cache.tokens_per_block}; set only the latter"
            ),
        )


def engine_findings(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    names = list(_names(recipe))
    yield from names
    if names or m is None:
        return
    cfg = predicted_checkpoint_config(m, recipe)
    gpu = get_gpu(recipe.engine.gpu)
    llmapi = recipe.target == "llmapi"  # no trtllm-build: only the memory plan applies
    defaults = {f.name: f.default for f in FIELDS}
    # a pre-quantized source's own algorithm is named against model.source by the import rules
    # (trtpipe.quant.imported.rules): only what the recipe itself asks for is reported under its keys here
    q = recipe.quantization
    source_only = {
        k
        for k, mine in (
            ("quantization.algo", q.algo),
            ("quantization.group_size", q.algo),
            ("quantization.kv_cache", q.kv_cache),
        )
        if mine == "none"
    }
    target = bc.builder_target(cfg, gpu)
    if llmapi:  # no builder, but the same tensor cores: FP8 / FP4 GEMMs below their SM fail at load
        missing = tensor_core_rejections(target)
        for key, reason in missing:  # a pre-quantized source's own format is named against model.source
            yield (
                (key, reason)
                if key not in source_only
                else ("engine.gpu", f"model.source on {recipe.engine.gpu}: {reason}")
            )
        if missing:
            return
    early = rejections(defaults, target)
    if early and not llmapi:  # the quantization itself is rejected on this GPU: no preset could help
        for key, reason in early:
            if key not in source_only:  # a group size is refused by the GEMM at inference, not by the builder
                yield key, reason if key == "quantization.group_size" else f"trtllm-build rejects this: {reason}"
        return
    try:
        build = bc.resolve_build(recipe, cfg, gpu)
    except EngineError as exc:
        if not llmapi:
            yield _as_finding(exc, "engine.plugins")
        return
    if not llmapi:
        yield from _build_findings(recipe, build)
    from trtpipe.engine.planner import plan_build

    plan = plan_build(recipe, cfg, build)
    if not plan.fits:
        yield "engine.gpu", plan.refusal


def _build_findings(recipe: Recipe, build) -> Iterable[Finding]:
    """What trtllm-build and the engine's runtime would refuse or silently change (engine target only)."""
    yield from bc.findings(build)
    p = build.config.plugins
    if recipe.triton.batching_strategy in IFB_STRATEGIES:
        missing = [
            n
            for n, ok in (
                ("gpt_attention_plugin", p["gpt_attention_plugin"] != "disable"),
                ("remove_input_padding", p["remove_input_padding"]),
                ("paged_kv_cache", p["paged_kv_cache"]),
            )
            if not ok
        ]
        if missing:
            yield (
                "engine.plugins",
                (
                    f"in-flight batching (triton.batching_strategy {recipe.triton.batching_strategy}) "
                    f"needs {', '.join(missing)} enabled"
                ),
            )
    if (
        recipe.engine.kv_cache.enable_reuse
        and not p["use_paged_context_fmha"]
        and recipe.quantization.kv_cache != "int8"
    ):
        yield (
            "engine.kv_cache.enable_reuse",
            (
                "KV reuse needs paged context FMHA, which this build has off "
                "(the runtime would silently disable reuse); set enable_reuse: false"
            ),
        )


def _source_builder_rejects(recipe: Recipe, m: ModelDims, fmt) -> Iterable[Finding]:
    """What trtllm-build rejects of the source's quantization on ``engine.gpu`` (e.g. NVFP4 below SM 10.0): the
    builder rules of :func:`trtpipe.engine.enforce.rejections`, keyed by the source's quant_algo and named against
    model.source (the engine rules report only what the recipe's own quantization section asks for)."""
    try:
        gpu = get_gpu(recipe.engine.gpu)
    except EngineError:
        return  # an unknown GPU is named by the engine rules
    target = Target(
        gpu.sm, m.architecture, fmt.quant_algo, fmt.kv_cache, recipe.parallel.tp, recipe.parallel.pp, fmt.group_size
    )
    for key, reason in rejections({}, target):
        if key == "quantization.group_size":  # the source's groups, on any GPU: another checkpoint is the fix
            yield (
                "model.source",
                f"model.source is {fmt.describe()}: {reason}; use a checkpoint quantized with one "
                "of those group sizes, or target: llmapi",
            )
        elif key.startswith("quantization."):
            yield (
                "engine.gpu",
                f"model.source is {fmt.describe()}: trtllm-build rejects it on {recipe.engine.gpu}: {reason}",
            )


def source_findings(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """A pre-quantized ``model.source`` built into engines: what trtllm-build rejects of its format on
    ``engine.gpu`` (its other problems are the import rules' findings, :mod:`trtpipe.quant.imported.rules`)."""
    if m is None or recipe.target != "engine" or family_refuses(recipe, m):
        return
    try:
        fmt = source_format(recipe, m)
    except CheckpointError:
        return  # named by the import rules
    if fmt is not None and fmt.quant_algo and fmt.action("engine").ok:
        yield from _source_builder_rejects(recipe, m, fmt)


ENGINE_RULES: tuple[Rule, ...] = (engine_findings, source_findings)
