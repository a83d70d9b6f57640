"""The quantized TRT-LLM checkpoint layouts trtpipe writes: recipe algo -> tensors, dtypes (facts: formats.schemes).

Source of truth: what NVIDIA ModelOpt 0.47.0 writes (``modelopt/torch/export/``, checked by running it:
tests/quant/test_oracle.py) and trtllm-build 1.x reads (docs/reference/trtllm-checkpoint.md#quantized-tensors). Every
difference between algorithms is a field of :class:`Algo`; code never branches on the algorithm's name. Per-linear
tensors (suffixes of ``transformer.layers.{i}.<linear>``):

==============  ===========  =======================  ================  ===============  ==========
algo            weight       weights_scaling_factor   prequant (dtype)  activation sf    wsf_2
==============  ===========  =======================  ================  ===============  ==========
fp8             F8_E4M3      F32 [1]                  -                 F32 [1]          -
int8_sq         I8           F32 [out]                model [in]        F32 [1]          -
int8_wo         I8           F32 [out]                -                 -                -
int4_wo         I8 [out/2]   F32 [out, in/g]          model [in] = 1    -                -
int4_awq        I8 [out/2]   F32 [out, in/g]          model [in]        -                -
w4a8_awq        I8 [out/2]   F32 [out, in/g]          model [in]        F32 [1]          F32 [1]
==============  ===========  =======================  ================  ===============  ==========

Shared-scale rules (ModelOpt ``preprocess_linear_fusion``): q/k/v are one fused linear (one per-tensor scale,
one pre-quant scale); ``mlp.fc`` and ``mlp.gate`` read the same input, so they share the pre-quant scale, the
activation scale and (FP8 / W4A8 second level) the per-tensor weight scale, the max over both.
KV cache: ``attention.{k,v,kv}_cache_scaling_factor`` F32 [1]; FP8 scales clamped to >= 1.0 as ModelOpt does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trtpipe.formats.schemes import BY_RECIPE, KV_BY_RECIPE

# The linears of a Llama decoder layer in TRT-LLM names, grouped by the input they read.
# group name -> (members, parallel style)
LINEAR_GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "attention.qkv": (("attention.qkv",), "column"),
    "attention.dense": (("attention.dense",), "row"),
    "mlp.fc+gate": (("mlp.fc", "mlp.gate"), "column"),
    "mlp.proj": (("mlp.proj",), "row"),
}
LINEARS: tuple[str, ...] = tuple(m for members, _ in LINEAR_GROUPS.values() for m in members)
STYLE: dict[str, str] = {m: style for members, style in LINEAR_GROUPS.values() for m in members}

# Mixture-of-experts linears of the engine checkpoint (``mlp.fc`` [E, 2I, H]: each expert's up rows then gate rows;
# ``mlp.proj`` [E, H, I]), per rank (E_r = E / moe_ep experts, I_r = I / moe_tp of each expert's width), as
# TensorRT-LLM 1.2's MoE layer reads them (NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py MOEWeightWrapper):
#
# * fp8: ``weights_scaling_factor`` F32 [E_r, 1] (one per expert; an expert's up and gate share the max),
#   ``activation_scaling_factor`` F32 [1] (the max over the experts: the plugin has one).
# * int4_awq, int4_wo (W4A16_AWQ; int4_wo's pre-quant scale is ones): ``weight`` I8 [E_r, out/2, in] (each expert
#   packed as a dense linear: two adjacent output rows per byte, the even one in the low nibble),
#   ``weights_scaling_factor`` F32 [E_r, out, in/g],
#   ``prequant_scaling_factor`` model dtype [in], ONE for all the experts of the linear (fc: hidden; proj: I_r).
#   These are the raw codes ModelOpt's TRT-LLM export writes (modelopt/torch/export/quant_utils.py
#   ``pack_int4_in_uint8``, its 3-D branch, viewed as int8 by model_config_utils.py ``pack_linear_weights``;
#   NVIDIA/TensorRT-Model-Optimizer@5a4242fa): ``trtllm-build`` itself turns them into the plugin's layout when it
#   loads the checkpoint, on the host (NVIDIA/TensorRT-LLM@b35ac1b6 tensorrt_llm/models/modeling_utils.py
#   ``from_checkpoint`` -> ``preprocess_weights`` -> ``preprocess_perlayer_weights``: every int8 ``weight`` is
#   transposed to [E, in, out/2] and run through ``preprocess_weights_for_mixed_gemm`` (3-D: the SM80 interleave,
#   a pure torch function) and viewed as the model dtype, [E_r, in, out/4]; ``weights_scaling_factor`` transposed
#   to [E_r, in/g, out] in the model dtype; a 2-D ``prequant_scaling_factor`` keeps its row 0 ("MoE experts share
#   the same scaling factor"), any one is reshaped to [1, in]). ModelOpt writes that scale stacked [E, in] with
#   equal rows (``build_stacked_experts``: ``preprocess_linear_fusion(experts, resmooth_only=True)``, the mean of
#   the experts' AWQ scales); trtpipe writes the one row, the same tensor after the builder's reshape. The layer
#   takes group_size / has_zero_point / pre_quant_scale from the config's quantization
#   (NVIDIA/TensorRT-LLM@89fd9b74 tensorrt_llm/quantization/quantize.py ``weight_only_groupwise_quantize``, whose
#   map re-creates ``MixtureOfExperts`` with them).
#
# recipe algo -> why its experts have no engine layout: the scheme table's ``moe_why["engine"]``
# (trtpipe.formats.schemes, with the upstream citations). W4A8: the MoE layer takes W4A8 group scales interleaved
# ([E, in/(g*f), out*f], ``get_weight_scale_interleave_factor``) with a per-expert ``alpha`` [E, 1], while the
# builder's W4A8 preprocessing is written for dense linears (it divides the [E, in/g, out] group scales by
# ``weights_scaling_factor_2`` and forms ``alpha`` per linear, no interleave; modeling_utils.py@b35ac1b6): not a
# layout trtpipe can write and show loadable from source alone.
MOE_ENGINE_REFUSED: dict[str, str] = {
    s.recipe: s.moe_why["engine"] for s in BY_RECIPE.values() if "engine" in s.targets and "engine" not in s.moe
}
# an experts' tensor every expert of a linear shares (no expert axis in trtpipe's checkpoint): the builder keeps row 0
# of a stacked [E, in] one, so the reference runtime does too (modeling_utils.py@b35ac1b6 preprocess_perlayer_weights)
SHARED_BY_EXPERTS = ("prequant_scaling_factor",)

# TensorRT-LLM's builder default exclusions; an explicit exclude_modules list replaces them, so we keep them.
BUILDER_DEFAULT_EXCLUDES = (
    "*lm_head",
    "*router",
    "*vocab_embedding",
    "*position_embedding",
    "*block_embedding",
    "*shared_expert_gate",
)


@dataclass(frozen=True)
class Algo:
    """How trtpipe's TRT-LLM checkpoint writer lays one algorithm out (its other facts: the scheme table row).

    Attributes:
        quant_algo: TRT-LLM ``quantization.quant_algo`` (the scheme's).
        weight_fmt: primitives format of the weight codes (``fp8``, ``int8``, ``int4``).
        granularity: ``tensor``, ``channel`` or ``group`` (the recipe's group_size): the scheme's ``scale``.
        act_fmt: static per-tensor activation format (None: weight-only).
        prequant: None, ``smooth`` (SmoothQuant), ``awq`` (scale search) or ``unit`` (explicit ones).
        weight_scale_2: also write ``weights_scaling_factor_2`` = amax(W)/448 (W4A8).
        group_config: write group_size / has_zero_point / pre_quant_scale into config.json (group-wise schemes).
        needs_samples: calibration must keep activation samples (AWQ search).
    """

    quant_algo: str
    weight_fmt: str
    granularity: str
    act_fmt: Optional[str] = None
    prequant: Optional[str] = None
    weight_scale_2: bool = False
    group_config: bool = False
    needs_samples: bool = False


def _algo(name: str, weight_fmt: str, **layout) -> Algo:
    s = BY_RECIPE[name]
    return Algo(s.quant_algo, weight_fmt, s.scale, group_config=s.groupwise, **layout)


# the schemes whose targets include "engine" (trtpipe.formats.schemes), as this writer lays them out
ALGOS: dict[str, Algo] = {
    "fp8": _algo("fp8", "fp8", act_fmt="fp8"),
    "int8_sq": _algo("int8_sq", "int8", act_fmt="int8", prequant="smooth"),
    "int8_wo": _algo("int8_wo", "int8"),
    "int4_wo": _algo("int4_wo", "int4", prequant="unit"),
    "int4_awq": _algo("int4_awq", "int4", prequant="awq", needs_samples=True),
    "w4a8_awq": _algo("w4a8_awq", "int4", act_fmt="fp8", prequant="awq", weight_scale_2=True, needs_samples=True),
}
# quant_algo -> how the reference runtime executes it (several recipe algos share one TRT-LLM layout).
BY_QUANT_ALGO: dict[str, Algo] = {a.quant_algo: a for a in ALGOS.values() if a.prequant != "unit"}


@dataclass(frozen=True)
class KVAlgo:
    kv_cache_quant_algo: str
    fmt: str
    min_scale: float  # ModelOpt clamps FP8 KV scales to >= 1.0 (clamp_fp8_scales)


KV_ALGOS: dict[str, KVAlgo] = {
    name: KVAlgo(k.kv_cache_quant_algo, k.fmt, k.min_scale) for name, k in KV_BY_RECIPE.items()
}
KV_TENSORS = ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor")

# Stored dtype of each per-linear tensor; "model" = the checkpoint dtype.
TENSOR_DTYPES = {
    "weights_scaling_factor": "float32",
    "weights_scaling_factor_2": "float32",
    "activation_scaling_factor": "float32",
    "prequant_scaling_factor": "model",
}


def quantization_config(algo_name: str, kv_cache: str, group_size: int, exclude: list[str]) -> dict:
    """The ``quantization`` dict of config.json (key order as ModelOpt writes it)."""
    algo = ALGOS.get(algo_name)
    q: dict = {
        "quant_algo": algo.quant_algo if algo else None,
        "kv_cache_quant_algo": KV_ALGOS[kv_cache].kv_cache_quant_algo if kv_cache != "none" else None,
    }
    if algo and algo.group_config:
        q.update(group_size=group_size, has_zero_point=False, pre_quant_scale=True)
    q["exclude_modules"] = exclude_modules(exclude)
    return q


def exclude_modules(patterns: list[str]) -> list[str]:
    """The recipe's patterns plus the builder defaults (an explicit list replaces them in TRT-LLM)."""
    out = list(patterns)
    for p in BUILDER_DEFAULT_EXCLUDES:
        if p not in out and p.lstrip("*") not in out:
            out.append(p)
    return out


def group_granularity(algo: Algo, group_size: int):
    """The primitives granularity of an algorithm's weights."""
    return group_size if algo.granularity == "group" else algo.granularity
