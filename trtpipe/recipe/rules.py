"""Cross-field rules, checked at validation time so a bad layout fails in a second, not after a long build.

A rule is a function ``(recipe, model) -> iterable of (dotted.key, message)``; ``model`` is the model's
:class:`HFModelInfo` (or None when the model directory cannot be read, which is itself reported).
Other packages add rules by appending to :data:`RULES` (the engine adds the builder's enforcement rules).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from trtpipe.errors import CheckpointError, Problem
from trtpipe.models.hfconfig import HFModelInfo, read_hf_config
from trtpipe.recipe.schema import Recipe

Finding = tuple[str, str]
Rule = Callable[[Recipe, Optional[HFModelInfo]], Iterable[Finding]]

RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def model_dir(recipe: Recipe):
    """The local model directory a recipe names (``hf://`` sources resolve through the hub cache)."""
    src = recipe.model.source
    if src.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        return resolve_hf(src)
    return recipe.resolve(src)


def load_model_info(recipe: Recipe) -> tuple[Optional[HFModelInfo], list[Finding]]:
    try:
        path = model_dir(recipe)
    except CheckpointError as exc:
        return None, [("model.source", str(exc))]
    if not path.is_dir():
        return None, [("model.source", f"model directory not found: {path}")]
    try:
        return read_hf_config(path), []
    except CheckpointError as exc:
        return None, [("model.source", str(exc))]


@rule
def _parallel_layout(recipe: Recipe, m: Optional[HFModelInfo]) -> Iterable[Finding]:
    p = recipe.parallel
    if p.world_size > 64:
        yield "parallel", f"tp*pp = {p.world_size} ranks; at most 64 are supported"
    if m is None:
        return
    if m.num_heads % p.tp:
        yield "parallel.tp", f"{m.num_heads} attention heads do not divide by tp={p.tp}"
    if m.num_kv_heads >= p.tp and m.num_kv_heads % p.tp:
        yield "parallel.tp", f"{m.num_kv_heads} KV heads do not divide by tp={p.tp}"
    if m.num_kv_heads < p.tp and p.tp % m.num_kv_heads:
        yield "parallel.tp", (
            f"tp={p.tp} is not a multiple of the {m.num_kv_heads} KV heads (KV heads are replicated tp/kv times)"
        )
    if m.num_layers < p.pp:
        yield "parallel.pp", f"pp={p.pp} exceeds the model's {m.num_layers} layers"
    if not m.is_moe:
        if m.intermediate_size % p.tp:
            yield "parallel.tp", f"intermediate_size {m.intermediate_size} does not divide by tp={p.tp}"
        if p.moe_ep != -1 or p.moe_tp != -1:
            yield "parallel.moe_ep", "moe_ep/moe_tp apply only to mixture-of-experts models"
        return
    ep, mtp = resolve_moe_sizes(p.tp, p.moe_ep, p.moe_tp)
    if ep * mtp != p.tp:
        yield "parallel.moe_ep", f"moe_ep ({ep}) x moe_tp ({mtp}) must equal tp ({p.tp})"
    elif m.num_experts % ep:
        yield "parallel.moe_ep", f"{m.num_experts} experts do not divide by moe_ep={ep}"
    elif m.intermediate_size % mtp:
        yield "parallel.moe_tp", f"expert intermediate_size {m.intermediate_size} does not divide by moe_tp={mtp}"


def resolve_moe_sizes(tp: int, moe_ep: int, moe_tp: int) -> tuple[int, int]:
    """TensorRT-LLM's Mapping rule: both -1 means (ep=1, tp=tp); one given derives the other."""
    if moe_ep == -1 and moe_tp == -1:
        return 1, tp
    if moe_ep == -1:
        return max(1, tp // moe_tp), moe_tp
    if moe_tp == -1:
        return moe_ep, max(1, tp // moe_ep)
    return moe_ep, moe_tp


@rule
def _engine_limits(recipe: Recipe, m: Optional[HFModelInfo]) -> Iterable[Finding]:
    e = recipe.engine
    if e.max_seq_len is not None and e.max_input_len > e.max_seq_len:
        yield "engine.max_input_len", f"{e.max_input_len} exceeds engine.max_seq_len {e.max_seq_len}"
    if recipe.triton.max_batch_size > e.max_batch_size:
        yield "triton.max_batch_size", (
            f"{recipe.triton.max_batch_size} exceeds engine.max_batch_size {e.max_batch_size}"
        )
    if e.kv_cache.enable_reuse and recipe.quantization.kv_cache == "int8":
        yield "engine.kv_cache.enable_reuse", (
            "KV reuse needs paged context FMHA, which INT8 KV cache disables; use kv_cache: fp8 or enable_reuse: false"
        )


@rule
def _calibration_data(recipe: Recipe, m: Optional[HFModelInfo]) -> Iterable[Finding]:
    q = recipe.quantization
    needs_data = q.algo in ("fp8", "int8_sq", "int4_awq", "w4a8_awq") or q.kv_cache != "none"
    if needs_data and q.calibration.dataset != "self" and not recipe.resolve(q.calibration.dataset).exists():
        yield "quantization.calibration.dataset", f"not found: {recipe.resolve(q.calibration.dataset)}"
    if recipe.accuracy.enabled and recipe.accuracy.eval_data != "self":
        if not recipe.resolve(recipe.accuracy.eval_data).exists():
            yield "accuracy.eval_data", f"not found: {recipe.resolve(recipe.accuracy.eval_data)}"


def check_recipe(recipe: Recipe) -> list[Problem]:
    """Run every rule; return all problems with the file position of the key each one names."""
    _load_plugin_rules()
    model, findings = load_model_info(recipe)
    findings = list(findings)
    for fn in RULES:
        findings.extend(fn(recipe, model))
    name = str(recipe.path) if recipe.path else "<recipe>"
    problems = []
    for key, message in findings:
        line, col = recipe.position(key)
        problems.append(Problem(name, line, col, key, message))
    return problems


def _load_plugin_rules() -> None:
    """Import the modules that register rules of their own (quantization layout, builder enforcement)."""
    import importlib

    for module in ("trtpipe.quant.rules", "trtpipe.engine.rules"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
