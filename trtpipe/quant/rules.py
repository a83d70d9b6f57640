"""Quantization layout rules, checked when the recipe is validated (before any weight is read).

Policy (docs/reference/trtllm-checkpoint.md#quantized-tensors): an int4 linear must have an even number of output rows
per rank and whole groups in every rank's input slice (no partial groups: ModelOpt and the TRT-LLM AWQ layers reject
them). Every linear that breaks this is listed with the fix: a smaller ``group_size`` that works, or an ``exclude``
pattern that keeps it unquantized. ``lm_head`` stays unquantized (the quantized layouts here do not cover it), so
``*lm_head`` must stay in ``exclude``. Mixture-of-experts models: fp8 (per-expert weight scales), KV-cache
quantization; on the engine target int4_awq / int4_wo (W4A16_AWQ experts stacked as TensorRT-LLM 1.2's MoE layer
reads them, trtpipe.checkpoint.quant_layouts; int4_awq calibrated on the tokens routed to each expert), with every
rank's slice of an expert in whole groups and an even number of its rows (moe_tp splits the experts); on
``target: llmapi`` w4a8_awq (written as ModelOpt's W4A8_AWQ linears, the one int4 layout TensorRT-LLM's fused MoE
loads: trtpipe.export.rules). :data:`MOE_ENGINE_REFUSED` says why the others are not written for the engine.
TensorRT-LLM quantizes a MoE layer as one module: ``quantize_layers`` rebuilds ``transformer.layers.{i}.mlp``
unquantized when an exclude pattern matches that name, and with the config's quant mode otherwise
(NVIDIA/TensorRT-LLM@89fd9b74 tensorrt_llm/quantization/quantize.py), while trtpipe's writer decides per linear
(``mlp.fc``, ``mlp.proj``); exclude patterns that match some of the three names of a layer but not all would
write a checkpoint the builder cannot load, and are refused.
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Optional

from trtpipe.checkpoint.quant_layouts import ALGOS, MOE_ENGINE_REFUSED, STYLE
from trtpipe.formats.schemes import BY_RECIPE, needs_calibration_data
from trtpipe.models import num_params
from trtpipe.models.dims import ModelDims
from trtpipe.models.trtllm_config import resolve_moe_sizes
from trtpipe.quant.hostmem import whole_model_misfit
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe


def linear_dims(m: ModelDims) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder linear, unsharded, in TRT-LLM names."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return {
        "attention.qkv": (q + 2 * kv, m.hidden_size),
        "attention.dense": (m.hidden_size, q),
        "mlp.fc": (m.expert_intermediate_size, m.hidden_size),  # one expert's, for MoE models
        "mlp.gate": (m.expert_intermediate_size, m.hidden_size),
        "mlp.proj": (m.hidden_size, m.expert_intermediate_size),
    }


def per_rank(name: str, out_f: int, in_f: int, tp: int) -> tuple[int, int]:
    return (out_f // tp, in_f) if STYLE[name] == "column" else (out_f, in_f // tp)


def int4_problems(
    m: ModelDims, tp: int, group_size: int, moe_tp: Optional[int] = None, row_pairs: bool = True
) -> dict[str, str]:
    """linear -> why it cannot be int4 at this tp and group size (empty: all fine); a MoE model's experts are split
    by ``moe_tp`` (default: tp). ``row_pairs``: the codes pack two output rows a byte (INT4 AWQ), so each rank's
    rows must be even (NVFP4 packs along the inputs, which whole groups already keep even)."""
    bad = {}
    for name, (o, i) in linear_dims(m).items():
        split = moe_tp if m.is_moe and name.startswith("mlp.") and moe_tp else tp
        o_r, i_r = per_rank(name, o, i, split)
        if i_r % group_size:
            bad[name] = (
                f"in_features {i_r}{' per rank' if split > 1 and STYLE[name] == 'row' else ''} "
                f"is not a multiple of group_size {group_size}"
            )
        elif o_r % 2 and row_pairs:
            bad[name] = f"{o_r} output rows per rank is odd (int4 packs row pairs)"
    return bad


# a MoE layer's module and its experts' linears (names in a layer): exclude patterns must match all or none of them
MOE_MODULES = ("mlp", "mlp.fc", "mlp.proj")


def excluded(name: str, patterns: list[str]) -> bool:
    full = f"transformer.layers.0.{name}"
    return any(fnmatch.fnmatchcase(full, p) for p in patterns)


def _moe_engine(recipe: Recipe, m: ModelDims) -> Iterable[Finding]:
    """A MoE model's quantized experts on the engine target: the algorithms with an expert layout, and excludes."""
    q = recipe.quantization
    if q.algo in MOE_ENGINE_REFUSED:
        why = MOE_ENGINE_REFUSED[q.algo]
        yield (
            "quantization.algo",
            (
                f"{q.algo} for mixture-of-experts models is written only for target: llmapi ({why}); set target: llmapi, "
                "or use int4_awq or fp8"
                if q.algo == "w4a8_awq"
                else f"{q.algo} is not supported for mixture-of-experts models on target engine: {why}; use int4_awq, fp8 or "
                "none, or w4a8_awq with target: llmapi"
            ),
        )
        return
    for i in range(m.num_layers):
        names = [f"transformer.layers.{i}.{n}" for n in MOE_MODULES]
        hit = {n: [p for p in q.exclude if fnmatch.fnmatchcase(n, p)] for n in names}
        if len({bool(v) for v in hit.values()}) > 1:
            which = ", ".join(f"{n} ({', '.join(map(repr, v))})" for n, v in hit.items() if v)
            rest = ", ".join(n for n, v in hit.items() if not v)
            yield (
                "quantization.exclude",
                (
                    f"the patterns exclude {which} but not {rest}: TensorRT-LLM quantizes a mixture-of-experts layer as "
                    "one module (an excluded transformer.layers.N.mlp is rebuilt unquantized, its experts fc and proj "
                    "with it), so exclude all three (e.g. '*mlp*') or none"
                ),
            )
            return


def _quant_layout(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    q = recipe.quantization
    algo = ALGOS.get(q.algo)
    if algo is None and q.kv_cache == "none":
        return
    if not any(fnmatch.fnmatchcase("lm_head", p) for p in q.exclude):
        yield "quantization.exclude", "lm_head is kept unquantized: keep '*lm_head' in the list"
    if m is None or algo is None:
        return
    if m.is_moe and recipe.target != "llmapi":  # llmapi: the export's own rule
        found = list(_moe_engine(recipe, m))
        yield from found
        if found:
            return
    if algo.weight_fmt != "int4":
        return
    tp = recipe.parallel.tp
    moe_tp = resolve_moe_sizes(tp, recipe.parallel.moe_ep, recipe.parallel.moe_tp)[1]
    bad = {n: why for n, why in int4_problems(m, tp, q.group_size, moe_tp).items() if not excluded(n, q.exclude)}
    if not bad:
        return
    # the engine's group-wise GEMM runs only some group sizes (the scheme table's group_sizes)
    sizes = BY_RECIPE[q.algo].group_sizes_for(recipe.target)
    remaining = {g: sorted(n for n in int4_problems(m, tp, g, moe_tp) if not excluded(n, q.exclude)) for g in sizes}
    best = min(sizes, key=lambda g: (len(remaining[g]), -g))
    parts = [f"group_size {best}"] if best != q.group_size else []
    experts = [n for n in remaining[best] if m.is_moe and n.startswith("mlp.")]  # not excludable (_moe_engine)
    if len(experts) < len(remaining[best]):
        parts.append(
            "add " + ", ".join(repr("*" + n) for n in remaining[best] if n not in experts) + " to quantization.exclude"
        )
    if experts:
        parts.append(
            f"a moe_tp that leaves {', '.join(experts)} whole groups and even rows per rank (more "
            "parallel.moe_ep), or fp8"
        )
    fix = " and ".join(parts)
    for name, why in bad.items():
        yield "quantization.group_size", f"{q.algo} at tp={tp}: {name} {why}; fix: {fix}"


def _self_data_fits(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """``self`` data is sampled from the whole unquantized model in float32 on the host: refuse it up front for a
    model that does not fit (calibration and verification themselves run one layer at a time)."""
    if m is None:
        return
    q, acc = recipe.quantization, recipe.accuracy
    algo = ALGOS.get(q.algo)
    keys = []
    if q.calibration.dataset == "self" and needs_calibration_data(q.algo, q.kv_cache):
        keys.append("quantization.calibration.dataset")
    if acc.eval_data == "self" and acc.enabled and (algo is not None or q.kv_cache != "none"):
        keys.append("accuracy.eval_data")
    why = whole_model_misfit(4 * num_params(m)) if keys else None
    if why:
        for key in keys:
            yield (
                key,
                (f"'self' samples text from the whole model, and {why}; name a .txt, .jsonl or .json dataset instead"),
            )


QUANT_RULES: tuple[Rule, ...] = (_quant_layout, _self_data_fits)
