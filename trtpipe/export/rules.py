"""Recipe rules of the llmapi target, checked at validation time (before any weight is read).

TensorRT-LLM's PyTorch backend loads a pre-quantized checkpoint through one linear method per ``quant_algo``;
INT8 SmoothQuant has none (``ValueError('unsupported quant mode')`` at load) and an INT8 KV cache is rejected for
pre-quantized checkpoints (the KV scheme table's llmapi column). Those are refused here with the reason and what to use instead,
rather than after calibration and export.

Mixture-of-experts experts go through the CUTLASS fused MoE, whose ``_get_quant_method`` sends every int4 per-group
checkpoint to ``WInt4AFP8FusedMoEMethod``, i.e. W4A8 (NVIDIA/TensorRT-LLM@7b437aaa
``tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py``, ``fused_moe/quantization.py``): it reads each
expert's ``input_scale`` and ``weight_scale_2`` besides the group scales and the pre-quant scale, so W4A16 AWQ
experts (``int4_awq``, ``int4_wo``) do not load, and its kernels need K, the hidden size and the expert width per
moe_tp rank, to be multiples of 128, in groups of 128 (its per-group scale tensors are ``[E, K/128, ...]``;
SM89/SM90 only).
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.export.formats import MOE_EXPORT_ALGOS
from trtpipe.formats.schemes import BY_RECIPE, KV_SCHEMES, written_for
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe

# recipe algo -> why the llmapi target cannot take it, and what to use instead
LLMAPI_REFUSED_ALGOS = {
    "int8_sq": (
        "INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL) cannot be loaded by TensorRT-LLM's PyTorch backend "
        "(it has no linear method for it)",
        "use fp8 or fp8_pc_pt (Ada/Hopper/Blackwell), w4a8_awq or int4_awq, or target: engine (TensorRT-LLM <= 1.2)",
    ),
}
LLMAPI_KV = " or ".join(k.kv_cache_quant_algo for k in KV_SCHEMES if k.llmapi)
LLMAPI_REFUSED_KV = {
    k.recipe: (
        f"an {k.kv_cache_quant_algo} KV cache is rejected by TensorRT-LLM's PyTorch backend for pre-quantized "
        f"checkpoints (only {LLMAPI_KV})",
        "use kv_cache: fp8, or target: engine (TensorRT-LLM <= 1.2)",
    )
    for k in KV_SCHEMES
    if k.recipe and not k.llmapi
}
# the algos whose experts this export writes (the scheme table's moe column), in its advice order
MOE_WRITTEN = MOE_EXPORT_ALGOS[1:]
NOT_W4A8 = " or ".join(a for a in MOE_WRITTEN if a != "w4a8_awq")  # what W4A8 experts' shape refusals advise
MOE_ADVICE = f"use {MOE_WRITTEN[-1]}, or {' or '.join(MOE_WRITTEN[:-1])}"
# recipe algo -> why TensorRT-LLM's fused MoE does not load it as MoE experts (the scheme table's moe_why), and what
# to use instead
MOE_REFUSED_ALGOS = {a: (s.moe_why["llmapi"], MOE_ADVICE) for a, s in BY_RECIPE.items() if "llmapi" in s.moe_why}
# W4A8 experts (WInt4AFP8FusedMoEMethod): K of both GEMMs a multiple of this, and it is the group size
MOE_W4A8_K = 128
# recipe algos that only the llmapi export writes (no TRT-LLM-checkpoint layout in trtpipe)
LLMAPI_ONLY_ALGOS = tuple(a for a in written_for("llmapi") if a not in written_for("engine"))


def _llmapi_target(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    q = recipe.quantization
    if recipe.target != "llmapi":
        if q.algo in LLMAPI_ONLY_ALGOS:
            yield (
                "quantization.algo",
                (
                    f"{q.algo} is written only for target: llmapi (the engine path's "
                    "checkpoint writer has no layout for it); set target: llmapi or use fp8"
                ),
            )
        return
    if q.algo in LLMAPI_REFUSED_ALGOS:
        why, alternatives = LLMAPI_REFUSED_ALGOS[q.algo]
        yield "quantization.algo", f"{q.algo} is refused for target llmapi: {why}; {alternatives}"
    if q.kv_cache in LLMAPI_REFUSED_KV:
        why, alternatives = LLMAPI_REFUSED_KV[q.kv_cache]
        yield "quantization.kv_cache", f"kv_cache {q.kv_cache} is refused for target llmapi: {why}; {alternatives}"
    if m is not None and m.is_moe:
        yield from _moe_experts(recipe, m)
    block = BY_RECIPE[q.algo].block if q.algo in BY_RECIPE else None
    if m is not None and block:
        import fnmatch

        from trtpipe.quant.rules import linear_dims

        for name, (_, in_f) in linear_dims(m).items():
            if in_f % block and not any(fnmatch.fnmatchcase(f"transformer.layers.0.{name}", p) for p in q.exclude):
                yield (
                    "quantization.algo",
                    (
                        f"{q.algo}: {name} has in_features {in_f}, not a multiple of {block} "
                        f"({BY_RECIPE[q.algo].quant_algo} blocks); add '*{name}' to "
                        "quantization.exclude"
                    ),
                )
    if recipe.llmapi.compressed_tensors and q.algo not in COMPRESSED_TENSORS_ALGOS:
        yield (
            "llmapi.compressed_tensors",
            (
                f"no compressed-tensors scheme for quantization.algo {q.algo}; "
                f"supported: {', '.join(COMPRESSED_TENSORS_ALGOS)}"
            ),
        )


def _moe_experts(recipe: Recipe, m: ModelDims) -> Iterable[Finding]:
    """The experts' algo and, for W4A8, the shapes TensorRT-LLM's fused MoE takes (module docstring)."""
    from trtpipe.models.trtllm_config import resolve_moe_sizes

    q = recipe.quantization
    if q.algo in MOE_REFUSED_ALGOS:
        why, alternatives = MOE_REFUSED_ALGOS[q.algo]
        yield (
            "quantization.algo",
            f"{q.algo} is refused for mixture-of-experts models on target llmapi: {why}; {alternatives}",
        )
        return
    if q.algo not in MOE_EXPORT_ALGOS:
        yield (
            "quantization.algo",
            (
                f"{q.algo}: the llmapi export writes mixture-of-experts experts unquantized, in "
                f"{', '.join(MOE_WRITTEN[:-1])} or {MOE_WRITTEN[-1]} (supported: "
                f"{', '.join(MOE_EXPORT_ALGOS)}); use one of them"
            ),
        )
        return
    if q.algo != "w4a8_awq":
        return
    k = MOE_W4A8_K
    if q.group_size != k:
        yield (
            "quantization.group_size",
            (
                f"w4a8_awq mixture-of-experts experts are loaded by TensorRT-LLM in groups "
                f"of {k} only (got {q.group_size}); set group_size: {k}"
            ),
        )
    if m.hidden_size % k:
        yield (
            "model.source",
            (
                f"w4a8_awq: hidden_size {m.hidden_size} is not a multiple of {k} (K of the experts' "
                f"gate/up GEMM in TensorRT-LLM's fused W4A8 MoE); use {NOT_W4A8}"
            ),
        )
    moe_tp = resolve_moe_sizes(recipe.parallel.tp, recipe.parallel.moe_ep, recipe.parallel.moe_tp)[1]
    width = m.expert_intermediate_size // moe_tp
    if width % k:
        key = "parallel.moe_tp" if moe_tp > 1 else "model.source"
        yield (
            key,
            (
                f"w4a8_awq: the expert width {m.expert_intermediate_size} is {width} per moe_tp rank "
                f"(moe_tp={moe_tp}), not a multiple of {k} (K of the experts' down GEMM in TensorRT-LLM's fused "
                f"W4A8 MoE); use a smaller moe_tp (more moe_ep), or {NOT_W4A8}"
            ),
        )


# recipe algo -> compressed-tensors scheme written (the scheme table's compressed column; trtpipe.export.compressed)
COMPRESSED_TENSORS_ALGOS = tuple(a for a, s in BY_RECIPE.items() if s.compressed)


EXPORT_RULES: tuple[Rule, ...] = (_llmapi_target,)
