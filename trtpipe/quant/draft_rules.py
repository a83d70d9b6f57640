"""The draft model's quantization (``speculative.draft_quantization``): which drafts the draft_engine stage quantizes
with the recipe's ``quantization`` section, and the rules checked at ``trtpipe validate`` (config files only).

Upstream's two-model form builds the draft like the target (``examples/draft_target_model/README.md@567239fc``);
here the draft of ``decoding_type: draft_tokens_external`` is quantized by the same code as the target's quantize
stage (:func:`trtpipe.stages.quant.run_calibration` / ``run_quantization``), so whatever the recipe's algorithm
refuses for the target it refuses for the draft's own dimensions: int4 group sizes and row pairs, a family that
takes no recipe quantization. A pre-quantized draft is not quantized twice (its codes would be rounded again
against scales nobody calibrated): it takes ``stored`` (its own format), or ``recipe`` when the recipe quantizes
nothing.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Optional

from pydantic import ValidationError

from trtpipe.checkpoint.quant_layouts import ALGOS
from trtpipe.errors import CheckpointError
from trtpipe.models import get_family
from trtpipe.models.dims import ModelDims, read_hf_config
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.rules import excluded, int4_problems
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import CalibrationSection, QuantizationSection, Recipe
from trtpipe.recipe.speculative import draft_dir

KEY = "speculative.draft_quantization"


def builds_draft(recipe: Recipe) -> bool:
    """The recipe has a draft_engine stage (the engine target's two-model form)."""
    return recipe.target == "engine" and recipe.speculative.decoding_type == "draft_tokens_external"


def recipe_quantizes(recipe: Recipe) -> bool:
    """The recipe's ``quantization`` asks for a quantized TensorRT-LLM checkpoint (the quantize stage runs)."""
    q = recipe.quantization
    return (q.algo != "none" or q.kv_cache != "none") and q.algo in ("none", *ALGOS)


def mode_label(recipe: Recipe) -> str:
    """``draft_quantization`` as messages name it: the word, or the mapping's keys and values."""
    mode = recipe.speculative.draft_quantization
    if isinstance(mode, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in mode.items()) + "}"
    return mode


def mapping_problem(mode: dict) -> Optional[tuple[str, str]]:
    """(key, message) of the first thing wrong in a ``draft_quantization`` mapping, or None: keys the
    quantization section does not have (``calibration``'s own keys included), then a value the section refuses."""
    keys = set(QuantizationSection.model_fields)
    unknown = sorted(set(mode) - keys)
    calib = mode.get("calibration")
    if isinstance(calib, dict):
        unknown += [f"calibration.{k}" for k in sorted(set(calib) - set(CalibrationSection.model_fields))]
    if unknown:
        return KEY, (
            f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: a mapping takes the quantization "
            f"section's keys ({', '.join(QuantizationSection.model_fields)}; calibration's: "
            f"{', '.join(CalibrationSection.model_fields)})"
        )
    try:
        QuantizationSection.model_validate(_merged(QuantizationSection(), mode))
    except ValidationError as exc:
        err = exc.errors()[0]
        return f"{KEY}.{'.'.join(str(p) for p in err['loc'])}", err["msg"]
    return None


def _merged(base: QuantizationSection, mode: dict) -> dict:
    """The section's values with the mapping's keys replaced (``calibration``'s one by one)."""
    out = base.model_dump()
    for k, v in mode.items():
        out[k] = {**out[k], **v} if k == "calibration" and isinstance(v, dict) else v
    return out


def draft_quant_recipe(recipe: Recipe) -> Optional[Recipe]:
    """The recipe whose ``quantization`` section the draft is quantized with (None: the draft is not quantized
    here): the recipe itself for ``recipe``, a copy with ``algo`` replaced for an algorithm name, a copy with the
    mapping's keys replaced for a mapping (an invalid mapping: None, its rule says why)."""
    mode = recipe.speculative.draft_quantization
    if not builds_draft(recipe) or mode in ("none", "stored"):
        return None
    if isinstance(mode, dict):
        if mapping_problem(mode) is not None:
            return None
        quant = QuantizationSection.model_validate(_merged(recipe.quantization, mode))
        recipe = recipe.model_copy(update={"quantization": quant})
    elif mode != "recipe":
        quant = recipe.quantization.model_copy(update={"algo": mode})
        recipe = recipe.model_copy(update={"quantization": quant})
    return recipe if recipe_quantizes(recipe) else None


def quantizes_draft(recipe: Recipe) -> bool:
    """The draft_engine stage calibrates and quantizes the draft (:func:`draft_quant_recipe`)."""
    return draft_quant_recipe(recipe) is not None


def _draft_quantization(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    s = recipe.speculative
    mode = s.draft_quantization
    if not builds_draft(recipe):
        if recipe.written(KEY) and s.enabled:
            yield (
                KEY,
                (
                    f"only decoding_type draft_tokens_external (target: engine) builds and quantizes a draft, not "
                    f"{s.decoding_type}: remove it"
                ),
            )
        return
    if isinstance(mode, dict):
        problem = mapping_problem(mode)
        if problem is not None:
            yield problem
            return
        mode = mode_label(recipe)
    elif mode not in ("recipe", "none", "stored") and mode not in ALGOS:
        yield (
            KEY,
            f"{mode} is written only for target: llmapi; a draft engine takes recipe, none, stored, "
            + ", ".join(ALGOS),
        )
        return
    path = draft_dir(recipe) if s.speculative_model is not None else None
    if path is None or not (path / "config.json").is_file():
        return  # speculative.speculative_model's own rule says so
    try:
        fmt = detect(path)
        draft = read_hf_config(path)
        family = get_family(draft.architecture)
    except CheckpointError:
        return  # the draft-model rule reports it
    dq = draft_quant_recipe(recipe)
    if fmt is not None:
        if mode == "none":
            yield KEY, f"none: the draft {path} is pre-quantized ({fmt.describe()}); use stored to serve its own format"
        elif dq is not None:
            yield (
                KEY,
                (
                    f"{mode}: the draft {path} is pre-quantized ({fmt.describe()}) and cannot be quantized again with "
                    f"algo {dq.quantization.algo} / kv_cache {dq.quantization.kv_cache}; use stored to serve its own format"
                ),
            )
        return
    if dq is None:
        return
    q = dq.quantization
    own = isinstance(s.draft_quantization, dict)
    exclude = f"{KEY}.exclude" if own and "exclude" in s.draft_quantization else "quantization.exclude"
    group = f"{KEY}.group_size" if own else "quantization.group_size"
    if mode != "recipe" and not any(fnmatch.fnmatchcase("lm_head", p) for p in q.exclude):
        yield KEY, f"{mode}: lm_head is kept unquantized: keep '*lm_head' in {exclude}"
        return
    if family.no_recipe_quantization:
        yield (
            KEY,
            (
                f"{mode}: {q.algo if q.algo != 'none' else q.kv_cache} is not supported for the draft's "
                f"{draft.architecture}: {family.no_recipe_quantization}; use none"
            ),
        )
        return
    algo = ALGOS.get(q.algo)
    if algo is None or algo.weight_fmt != "int4":
        return
    bad = {
        n: why
        for n, why in int4_problems(draft, recipe.parallel.tp, q.group_size).items()
        if not excluded(n, list(q.exclude))
    }
    for name, why in bad.items():
        yield (
            KEY,
            (
                f"{mode}: {q.algo} at tp={recipe.parallel.tp}: the draft's {name} {why}; add '*{name}' to "
                f"{exclude}, change {group}, or use none"
            ),
        )


DRAFT_QUANT_RULES: tuple[Rule, ...] = (_draft_quantization,)
