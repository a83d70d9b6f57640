"""THE table of quantized checkpoint layouts: recipe algo -> TRT-LLM quant_algo, formats, tensors, dtypes.

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

# Mixture-of-experts linears (``mlp.fc`` [E, 2I, H], ``mlp.proj`` [E, H, I]) of the engine checkpoint: FP8 per tensor
# only, as TensorRT-LLM 1.2's MoE layer reads them (NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py
# MOEWeightWrapper): ``weights_scaling_factor`` F32 [E, 1] (one per expert; an expert's up and gate share the max),
# ``activation_scaling_factor`` F32 [1] (the max over the experts). Why int4 experts have no layout here:
MOE_ENGINE_INT4 = ("the engine path's checkpoint writer has no layout for int4 experts: TensorRT-LLM 1.2's MoE plugin "
                   "takes them preprocessed [E, in, out/4] with [E, in/g, out] scales and one [1, in] pre-quant "
                   "scale, NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py MOEWeightWrapper")

# TensorRT-LLM's builder default exclusions; an explicit exclude_modules list replaces them, so we keep them.
BUILDER_DEFAULT_EXCLUDES = ("*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                            "*shared_expert_gate")


@dataclass(frozen=True)
class Algo:
    """One quantization algorithm, as data.

    Attributes:
        quant_algo: TRT-LLM ``quantization.quant_algo``.
        weight_fmt: primitives format of the weight codes (``fp8``, ``int8``, ``int4``).
        granularity: ``tensor``, ``channel`` or ``group`` (the recipe's group_size).
        act_fmt: static per-tensor activation format (None: weight-only).
        prequant: None, ``smooth`` (SmoothQuant), ``awq`` (scale search) or ``unit`` (explicit ones).
        weight_scale_2: also write ``weights_scaling_factor_2`` = amax(W)/448 (W4A8).
        group_config: write group_size / has_zero_point / pre_quant_scale into config.json.
        needs_samples: calibration must keep activation samples (AWQ search).
        needs_data: calibration data is needed at all.
    """

    quant_algo: str
    weight_fmt: str
    granularity: str
    act_fmt: Optional[str] = None
    prequant: Optional[str] = None
    weight_scale_2: bool = False
    group_config: bool = False
    needs_samples: bool = False

    @property
    def needs_data(self) -> bool:
        return self.act_fmt is not None or self.prequant in ("smooth", "awq")


ALGOS: dict[str, Algo] = {
    "fp8": Algo("FP8", "fp8", "tensor", act_fmt="fp8"),
    "int8_sq": Algo("W8A8_SQ_PER_CHANNEL", "int8", "channel", act_fmt="int8", prequant="smooth"),
    "int8_wo": Algo("W8A16", "int8", "channel"),
    "int4_wo": Algo("W4A16_AWQ", "int4", "group", prequant="unit", group_config=True),
    "int4_awq": Algo("W4A16_AWQ", "int4", "group", prequant="awq", group_config=True, needs_samples=True),
    "w4a8_awq": Algo("W4A8_AWQ", "int4", "group", act_fmt="fp8", prequant="awq", weight_scale_2=True,
                     group_config=True, needs_samples=True),
}
# quant_algo -> how the reference runtime executes it (several recipe algos share one TRT-LLM layout).
BY_QUANT_ALGO: dict[str, Algo] = {a.quant_algo: a for a in ALGOS.values() if a.prequant != "unit"}


@dataclass(frozen=True)
class KVAlgo:
    kv_cache_quant_algo: str
    fmt: str
    min_scale: float  # ModelOpt clamps FP8 KV scales to >= 1.0 (clamp_fp8_scales)


KV_ALGOS: dict[str, KVAlgo] = {
    "fp8": KVAlgo("FP8", "fp8", 1.0),
    "int8": KVAlgo("INT8", "int8", 0.0),
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
