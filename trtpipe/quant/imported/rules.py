"""Recipe rules of pre-quantized sources, checked at ``trtpipe validate`` (config files only, no weights).

* A pre-quantized ``model.source`` needs no ``quantization`` section; asking for an algorithm or a KV-cache format
  on it is refused (no double quantization: the codes would be rounded twice, against scales nobody calibrated).
* What the chosen target cannot load is refused with the reason and the alternative (the format's action).
* ``accuracy.reference`` names the unquantized original of a pre-quantized source; it is meaningless otherwise.
* A lossy step of the engine conversion (:mod:`.lossy`) that the source needs is refused unless
  ``model.allow_lossy_import`` lists it: FP8 from the weight-scale scalars of the fused members (the only tensors
  read here, a few bytes each), zero points from the model dtype. The key means nothing for the llmapi target (it
  has no lossy step) or for an unquantized source, and is refused there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.models import get_family
from trtpipe.models.dims import ModelDims
from trtpipe.quant.imported import lossy
from trtpipe.quant.imported.detect import detect, detect_config
from trtpipe.recipe.rules import Finding, Rule, model_dir
from trtpipe.recipe.schema import Recipe


def family_refuses(recipe: Recipe, m: ModelDims) -> bool:
    """The model-family rule already refuses this config (e.g. a quant_method gpt-oss cannot load) or this target
    (gpt-oss has no TensorRT engine)."""
    try:
        family = get_family(m.architecture)
    except CheckpointError:
        return True
    return any(True for _ in family.unsupported(m)) or bool(family.no_engine and recipe.target == "engine")


def source_format(recipe: Recipe, m: ModelDims):
    """The detected format: from the local directory, or (``hf://``) from the config.json already fetched."""
    local = None if recipe.model.source.startswith("hf://") else model_dir(recipe)
    if local is None or not (local / "config.json").is_file():
        # hf:// (hf_quant_config.json is not fetched here) or a config given apart (plan --model-config): from it
        return detect_config(Path(recipe.model.source), m.raw)
    return detect(local)


def _quantizes_only_the_rest(m: ModelDims) -> bool:
    """The family keeps the source's quantized modules as shipped (gpt-oss's MXFP4 experts), so the recipe's
    algorithm applies only to the modules the source holds unquantized: nothing is quantized twice."""
    method = (m.raw.get("quantization_config") or {}).get("quant_method")
    return method in get_family(m.architecture).shipped_quantization


def _imported_source(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    if m is None or family_refuses(recipe, m):  # an unknown architecture, a config or a target its family refuses:
        return  # said once, by the model-family rule
    try:
        fmt = source_format(recipe, m)
    except CheckpointError as exc:
        yield "model.source", str(exc)
        return
    q = recipe.quantization
    lossy_key = recipe.model.allow_lossy_import and (fmt is None or recipe.target != "engine")
    if lossy_key:
        yield (
            lossy.KEY,
            (
                "the llmapi target loads a pre-quantized source as stored or re-laid out exactly (no lossy "
                "step); remove it"
                if fmt is not None
                else "lists lossy steps of converting a pre-quantized source; this source is not quantized"
            ),
        )
    if fmt is None:
        if recipe.accuracy.reference is not None:
            yield (
                "accuracy.reference",
                (
                    "the reference is the unquantized original of a pre-quantized model.source; "
                    "this source is not quantized (the gate compares against it already)"
                ),
            )
        return
    for key, value in (("quantization.algo", q.algo), ("quantization.kv_cache", q.kv_cache)):
        if value != "none" and not _quantizes_only_the_rest(m):
            yield (
                key,
                (
                    f"model.source is already quantized ({fmt.describe()}); remove {key} (trtpipe does not "
                    "quantize a quantized checkpoint again)"
                ),
            )
    action = fmt.action(recipe.target)
    if not action.ok:
        yield "target", f"model.source is {fmt.describe()}: refused for target {recipe.target}: {action.why}"
    elif m.is_moe and recipe.target == "engine":
        from trtpipe.quant.imported.trtllm import moe_refusal

        why = moe_refusal(fmt)
        if why:
            yield (
                "target",
                (
                    f"model.source is {fmt.describe()}: its mixture-of-experts layers are refused for target "
                    f"engine: {why}"
                ),
            )
    if fmt.group_size and action.ok and recipe.target == "engine":
        yield from _whole_groups(recipe, m, fmt)
    if fmt.quant_algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" and action.ok and recipe.target == "engine":
        yield from _sq_alignment(recipe, m)
    if action.ok and recipe.target == "engine":
        yield from _lossy_steps(recipe, m, fmt)
    ref = recipe.accuracy.reference
    for key in ("max_ppl_increase_pct", "min_top1_agreement", "max_kl_divergence"):
        if ref is None and getattr(recipe.accuracy, key) is not None:
            yield (
                f"accuracy.{key}",
                (
                    "a pre-quantized source has no unquantized model to compare against: set "
                    "accuracy.reference to the original, or drop the threshold (perplexity alone "
                    "is reported)"
                ),
            )
    if ref is not None and not ref.startswith("hf://"):
        path = recipe.resolve(ref)
        if not (path / "config.json").is_file():
            yield "accuracy.reference", f"not a Hugging Face model directory (no config.json): {path}"
        else:
            try:
                ref_fmt = detect(path)
            except CheckpointError as exc:
                yield "accuracy.reference", str(exc)
                return
            if ref_fmt is not None:
                yield "accuracy.reference", f"the reference must be unquantized; it is {ref_fmt.describe()}"


def _whole_groups(recipe: Recipe, m: ModelDims, fmt) -> Iterable[Finding]:
    """Every rank's slice of a group-quantized linear holds whole groups (and row pairs): the checkpoint's groups
    cannot be re-cut, so a tp that splits one is refused here, naming the linear."""
    from trtpipe.models import get_family
    from trtpipe.quant.imported.canonical import LAYOUTS
    from trtpipe.quant.imported.trtllm import matches
    from trtpipe.models.trtllm_config import resolve_moe_sizes
    from trtpipe.quant.rules import int4_problems

    family = get_family(m.architecture)
    pre = m.weight_prefix + family.hf_layer_prefix.format(0)
    hf_of = {
        r.trt[: -len(".weight")]: [pre + h[: -len(".weight")] for h in r.hf]
        for r in family.layer_rules
        if r.when(m) and r.trt.endswith(".weight")
    }
    layout = LAYOUTS.get(fmt.quant_algo)
    row_pairs = layout is None or layout.weight_shape == "rows/2"  # INT4 packs output rows; NVFP4 packs the inputs
    tp = recipe.parallel.tp
    moe_tp = resolve_moe_sizes(tp, recipe.parallel.moe_ep, recipe.parallel.moe_tp)[1] if m.is_moe else None
    for name, why in int4_problems(m, tp, fmt.group_size, moe_tp, row_pairs=row_pairs).items():
        if all(matches(h, fmt.exclude) for h in hf_of.get(name, [])):
            continue  # left unquantized by the checkpoint
        at = f"tp={tp}" + (f" (moe_tp={moe_tp})" if moe_tp is not None and name.startswith("mlp.") else "")
        yield (
            "parallel.tp",
            (
                f"model.source is {fmt.name} with group size {fmt.group_size}: at {at} "
                f"{name} {why} (the checkpoint's groups cannot be re-cut); use a smaller tp"
                + (" or moe_tp" if moe_tp is not None and name.startswith("mlp.") else "")
            ),
        )


def _sq_alignment(recipe: Recipe, m: ModelDims) -> Iterable[Finding]:
    """Every rank's slice of a plugin SmoothQuant linear has in_features TensorRT-LLM's layer accepts (the
    conversion checks the same, as a backstop)."""
    from trtpipe.checkpoint.quant_layouts import LINEARS
    from trtpipe.models.family import shape_symbols
    from trtpipe.quant.imported.trtllm import sq_misaligned

    d = shape_symbols(m)
    for r in get_family(m.architecture).layer_rules:
        linear = r.trt[: -len(".weight")]
        if r.when(m) and r.trt.endswith(".weight") and linear in LINEARS and r.shapes:
            why = sq_misaligned(linear, d[r.shapes[0][1]], recipe.parallel.tp)
            if why:
                yield "parallel.tp", f"model.source is INT8 W8A8: {linear} {why}"
                return


def _fused_modules(m: ModelDims, layer: int) -> list[tuple[str, list[str]]]:
    """(TensorRT-LLM linear, its HF member modules) of each fused quantizable linear of ``layer``."""
    from trtpipe.checkpoint.quant_layouts import LINEARS
    from trtpipe.quant.imported.trtllm import rule_modules

    family = get_family(m.architecture)
    pre = m.weight_prefix + family.hf_layer_prefix.format(layer)
    out = []
    for r in family.layer_rules:
        linear = r.trt[: -len(".weight")]
        if not (r.when(m) and r.combine in ("cat", "experts_cat") and len(r.hf) > 1 and linear in LINEARS):
            continue
        modules = rule_modules(pre, r, m.num_experts)
        if r.combine == "cat":
            out.append((linear, modules))
        else:  # an expert's up/gate are fused as a dense gate/up is: one pair per expert
            num = m.num_experts
            out += [(f"{linear} expert {e}", modules[e::num]) for e in range(num)]
    return out


def _fp8_requantized(recipe: Recipe, m: ModelDims, fmt) -> list[str]:
    """Why each fused FP8 linear of the source needs fp8_requantize (its members' weight scales differ), read
    from those scalars alone."""
    from trtpipe.checkpoint.hf import HFReader
    from trtpipe.quant.imported.trtllm import matches

    whys = []
    with HFReader(model_dir(recipe), allow_pickle=recipe.model.allow_pickle, check_finite=False) as reader:
        for layer in range(m.num_layers):
            for fused, modules in _fused_modules(m, layer):
                names = [f"{h}.weight_scale" for h in modules]
                if any(matches(h, fmt.exclude) for h in modules) or any(n not in reader for n in names):
                    continue  # unquantized, or a missing tensor the conversion names
                scales = [float(reader.get(n).float().reshape(-1)[0]) for n in names]
                why = lossy.fp8_requantize_why(modules, scales, fused)
                if why is not None:
                    whys.append(why)
    return whys


def _nvfp4_unshared(recipe: Recipe, m: ModelDims, fmt) -> list[str]:
    """Why each fused NVFP4 linear of the source cannot be converted exactly (its members' ``weight_scale_2`` or
    ``input_scale`` differ), read from those scalars alone."""
    from trtpipe.checkpoint.hf import HFReader
    from trtpipe.quant.imported.trtllm import NVFP4_SHARED, matches, nvfp4_unshared_why

    whys = []
    with HFReader(model_dir(recipe), allow_pickle=recipe.model.allow_pickle, check_finite=False) as reader:
        for layer in range(m.num_layers):
            for fused, modules in _fused_modules(m, layer):
                names = [{s: f"{h}.{s}" for s, _ in NVFP4_SHARED} for h in modules]
                if any(matches(h, fmt.exclude) for h in modules) or any(
                    n not in reader for d in names for n in d.values()
                ):
                    continue  # unquantized, or a missing tensor the conversion names
                why = nvfp4_unshared_why(modules, [{s: reader.get(n) for s, n in d.items()} for d in names], fused)
                if why is not None:
                    whys.append(why)
    return whys


def _source_dtype(recipe: Recipe) -> str:
    """The checkpoint dtype the conversion writes (``model.dtype``, auto resolved as the checkpoint stage does)."""
    from trtpipe.checkpoint.convert import plan_first_source
    from trtpipe.checkpoint.hf import HFReader
    from trtpipe.models.trtllm_config import resolve_dtype

    if recipe.model.dtype != "auto":
        return recipe.model.dtype
    src = model_dir(recipe)
    with HFReader(src, allow_pickle=recipe.model.allow_pickle, check_finite=False) as reader:
        return resolve_dtype("auto", str(plan_first_source(src, reader)))


def _lossy_steps(recipe: Recipe, m: ModelDims, fmt) -> Iterable[Finding]:
    """The lossy steps the engine conversion of this source needs and the recipe does not accept, one line each
    (local sources: ``hf://`` weights are not fetched at validate; the conversion refuses them then)."""
    allowed = recipe.model.allow_lossy_import
    key = lossy.KEY if recipe.written(lossy.KEY) else "model.source"
    local = not recipe.model.source.startswith("hf://")
    try:
        if fmt.quant_algo == "FP8" and lossy.FP8_REQUANTIZE not in allowed and local:
            whys = _fp8_requantized(recipe, m, fmt)
            if whys:
                yield key, lossy.refusal(lossy.FP8_REQUANTIZE, whys[0], len(whys) - 1)
        if fmt.quant_algo == "NVFP4" and local:
            whys = _nvfp4_unshared(recipe, m, fmt)
            if whys:
                more = f" (and {len(whys) - 1} more fused linears)" if len(whys) > 1 else ""
                yield "model.source", whys[0] + more
        if (
            fmt.params.get("zero_point")
            and lossy.ZERO_POINT_ROUNDING not in allowed
            and (local or recipe.model.dtype != "auto")
        ):
            why = lossy.zero_point_why(f"{fmt.family} {fmt.name}", _source_dtype(recipe))
            if why is not None:
                yield key, lossy.refusal(lossy.ZERO_POINT_ROUNDING, why)
    except CheckpointError as exc:
        yield "model.source", str(exc)


IMPORT_RULES: tuple[Rule, ...] = (_imported_source,)
