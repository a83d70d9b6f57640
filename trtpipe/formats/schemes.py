"""THE quantization scheme table: one row per algorithm, every fact about it; everything else looks it up.

Like compressed-tensors' ``PRESET_SCHEMES`` (one row holds every facet of a scheme), a :class:`Scheme` carries the
algorithm's names in each format (the recipe's ``quantization.algo``, TensorRT-LLM's ``quant_algo`` (also the
unified-HF / ModelOpt name), the compressed-tensors preset), which targets write it, whether it needs calibration
data, bytes per weight, group sizes, the tensor cores (minimum SM) its GEMMs need, what the TensorRT-LLM builder
rejects on Blackwell, MoE support per target and the performance model's precision. The recipe's enum, validate's
rules, the memory planner, the writers, the importers and the predictor derive from :data:`SCHEMES`; a new
algorithm is a new row (plus the kernels of a new number format, in this package).

Rows with ``recipe=None`` are TensorRT-LLM algorithms trtpipe meets only in pre-quantized sources and builder
rules (GPTQ, the SmoothQuant plugin variants, block FP8, MXFP4 experts).

Sources of the columns (every citation the tables folded in here had):

* ``group_sizes["engine"]``: ``CutlassFpAIntBGemmRunner`` (the group-wise INT4 GEMM of W4A16 AWQ / GPTQ and W4A8 AWQ
  linears) throws at run time unless group_size is 64 or 128 ("Only group size 64 and 128 supported for fine
  grained kernels"), and 128 with FP8 activations ("Only group size 128 supported for fine grained W4A(fp)8
  kernels"), :data:`FINEGRAINED_SOURCE`.
* ``tensor_cores``: TensorRT-LLM's precision table lists FP4 for Blackwell (SM100/SM120) only and FP8, and INT4
  with FP8 activations, from SM89 (NVIDIA/TensorRT-LLM@9b062a83 ``docs/source/reference/support-matrix.md``);
  ``Fp4GemmPlugin::init``: ``TLLM_CHECK_WITH_INFO(getSMVersion() >= 100, "FP4 Gemm not supported before
  Blackwell")`` (``cpp/tensorrt_llm/plugins/fp4GemmPlugin/fp4GemmPlugin.cpp``, commit not recorded). These are the
  hardware's limits, so they hold for both targets (the builder and TensorRT-LLM's PyTorch backend).
* ``blackwell_dc``: ``builder.build`` of TensorRT-LLM 1.0-1.2 rejects weight-only INT8/INT4, SmoothQuant and
  per-channel/per-token scaling on SM 100-119 (engine target only; docs/reference/trtllm-build.md).
* ``moe_why["engine"]``: TensorRT-LLM 1.2's MoE layer (NVIDIA/TensorRT-LLM@c388fec7 ``tensorrt_llm/layers/moe.py``
  ``MOEWeightWrapper``); ``moe_why["llmapi"]``: the CUTLASS fused MoE sends every int4 per-group checkpoint to
  ``WInt4AFP8FusedMoEMethod`` (NVIDIA/TensorRT-LLM@7b437aaa ``_torch/modules/fused_moe/quantization.py``).
* ``weight_bytes``: codes per element plus fixed block scales (NVFP4: one FP8 scale per 16; MXFP4: one E8M0 byte
  per 32); per-group scales of ``groupwise`` rows are 16-bit, one per ``group_size`` inputs, counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

TARGETS = ("engine", "llmapi")
GROUP_SIZES = (32, 64, 128, 256)  # the recipe's group_size choices
FINEGRAINED_SOURCE = (
    "NVIDIA/TensorRT-LLM@567239fc cpp/tensorrt_llm/kernels/cutlass_kernels/fpA_intB_gemm/"
    "fpA_intB_gemm_template.h generic_mixed_gemm_kernelLauncher"
)


@dataclass(frozen=True)
class TensorCores:
    """The tensor cores a scheme's GEMMs need: the minimum SM and how a refusal says it."""

    name: str
    min_sm: int
    note: str = ""  # after the SM in a refusal
    why: str = ""  # after the target in a refusal


TENSOR_CORES: dict[str, TensorCores] = {
    "FP8": TensorCores("FP8", 89),
    "FP4": TensorCores(
        "FP4", 100, ", Blackwell", " (the FP4 GEMM plugin and the PyTorch backend's FP4 GEMMs refuse it)"
    ),
}

FP8_TENSOR = {"dynamic": False, "num_bits": 8, "type": "float"}
FP4_BLOCK = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}


@dataclass(frozen=True)
class Scheme:
    """One quantization algorithm (module docstring).

    Attributes:
        quant_algo: TensorRT-LLM ``quantization.quant_algo``; the unified-HF (ModelOpt) ``quant_algo`` too.
        recipe: the recipe's ``quantization.algo`` (ModelOpt qformat name); None: met only in sources.
        targets: the targets whose writer trtpipe has for it (engine: the TRT-LLM checkpoint; llmapi: unified HF).
        scale: the weight scales' granularity: ``tensor`` (one), ``channel`` (per output row) or ``group`` (per row
            and group of inputs: the recipe's ``group_size``, or the fixed ``block``).
        needs_data: calibration data is needed (static activation scales, AWQ or SmoothQuant search).
        weight_bytes: bytes per weight element (codes plus fixed block scales).
        groupwise: per-group scales of the recipe's ``group_size`` (16-bit each, counted apart).
        block: a fixed block size (NVFP4 16, MXFP4 32) instead of the recipe's group size.
        group_sizes: target -> the group sizes its GEMM runs (absent: any of :data:`GROUP_SIZES`).
        tensor_cores: the :data:`TENSOR_CORES` its GEMMs need (None: any GPU).
        blackwell_dc: the kind trtllm-build rejects on SM 100-119 (engine target), None: not rejected.
        fp8_context_fmha: the builder keeps FP8 context FMHA for it.
        moe: the targets that write its mixture-of-experts experts.
        moe_why: target -> why that target has no expert layout for it (recorded reasons).
        perf: the performance model's precision (:data:`trtpipe.perf.cost.PRECISIONS`); None: not modelled.
        peak: the GPU tensor peak its GEMMs run at (a :class:`trtpipe.formats.gpus.GPU` attribute).
        compressed: the compressed-tensors preset trtpipe writes for it (None: none).
        hf_config_groups: the inline ``config_groups`` ModelOpt writes for it in config.json (None: none).
        advise: its place in the quantizations a "does not fit" refusal advises, least lossy first (w4a8_awq where
            int4_awq is refused: MoE experts on llmapi); None: never advised.
    """

    quant_algo: str
    recipe: Optional[str] = None
    targets: tuple[str, ...] = ()
    scale: str = "channel"
    needs_data: bool = False
    weight_bytes: float = 1.0
    groupwise: bool = False
    block: Optional[int] = None
    group_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tensor_cores: Optional[str] = None
    blackwell_dc: Optional[str] = None
    fp8_context_fmha: bool = False
    moe: tuple[str, ...] = ()
    moe_why: Mapping[str, str] = field(default_factory=dict)
    perf: Optional[str] = None
    peak: Optional[str] = None
    compressed: Optional[str] = None
    hf_config_groups: Optional[dict] = None
    advise: Optional[int] = None

    @property
    def bits(self) -> int:
        """Bits per weight code."""
        return int(self.weight_bytes * 8)

    @property
    def min_sm(self) -> int:
        """The lowest SM whose tensor cores run its GEMMs (both targets)."""
        return TENSOR_CORES[self.tensor_cores].min_sm if self.tensor_cores else 0

    def group_sizes_for(self, target: str) -> tuple[int, ...]:
        return self.group_sizes.get(target, GROUP_SIZES)


ENGINE_LLMAPI = ("engine", "llmapi")
NO_SQ_EXPERTS = (
    "TensorRT-LLM 1.2's MoE layer has no SmoothQuant experts (FP8, weight-only, group-wise INT4 and NVFP4 "
    "only, NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py)"
)
INT4_MOE_LLMAPI = (
    "TensorRT-LLM's fused MoE loads int4 per-group experts only as W4A8 (FP8 activations, "
    "Ada/Hopper), which needs each expert's input_scale and weight_scale_2"
)

SCHEMES: tuple[Scheme, ...] = (
    Scheme(
        "FP8",
        "fp8",
        ENGINE_LLMAPI,
        "tensor",
        needs_data=True,
        tensor_cores="FP8",
        fp8_context_fmha=True,
        moe=ENGINE_LLMAPI,
        perf="fp8",
        peak="tflops_fp8",
        compressed="FP8",
        advise=1,
        hf_config_groups={"group_0": {"input_activations": FP8_TENSOR, "weights": FP8_TENSOR, "targets": ["Linear"]}},
    ),
    Scheme(
        "FP8_PER_CHANNEL_PER_TOKEN",
        "fp8_pc_pt",
        ("llmapi",),
        tensor_cores="FP8",
        blackwell_dc="per-channel/per-token",
        moe_why={
            "engine": "TensorRT-LLM 1.2's MoE layer refuses FP8 rowwise experts ('MOE Does not support FP8 "
            "rowwise quantize', NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py)"
        },
        perf="fp8",
        peak="tflops_fp8",
        compressed="FP8_DYNAMIC",
    ),
    Scheme(
        "W8A8_SQ_PER_CHANNEL",
        "int8_sq",
        ("engine",),
        needs_data=True,
        blackwell_dc="SmoothQuant",
        moe_why={"engine": NO_SQ_EXPERTS},
        perf="int8_sq",
        peak="tops_int8",
    ),
    Scheme(
        "W8A16",
        "int8_wo",
        ENGINE_LLMAPI,
        blackwell_dc="weight-only",
        moe_why={
            "engine": "trtpipe has no engine writer for INT8 weight-only experts (TensorRT-LLM 1.2's MoE "
            "plugin takes them preprocessed per GPU as [E, in, out] with an [E, out] "
            "per_channel_scale, NVIDIA/TensorRT-LLM@c388fec7 tensorrt_llm/layers/moe.py "
            "MOEWeightWrapper)"
        },
        perf="w8a16",
        peak="tflops_16",
    ),
    Scheme(
        "W4A16_AWQ",
        "int4_wo",
        ENGINE_LLMAPI,
        "group",
        weight_bytes=0.5,
        groupwise=True,
        group_sizes={"engine": (64, 128)},
        blackwell_dc="weight-only",
        moe=("engine",),
        moe_why={"llmapi": INT4_MOE_LLMAPI},
        perf="w4a16",
        peak="tflops_16",
        compressed="W4A16",
    ),
    Scheme(
        "W4A16_AWQ",
        "int4_awq",
        ENGINE_LLMAPI,
        "group",
        needs_data=True,
        weight_bytes=0.5,
        groupwise=True,
        group_sizes={"engine": (64, 128)},
        blackwell_dc="weight-only",
        moe=("engine",),
        moe_why={"llmapi": INT4_MOE_LLMAPI},
        perf="w4a16",
        peak="tflops_16",
        advise=3,
    ),
    Scheme(
        "W4A8_AWQ",
        "w4a8_awq",
        ENGINE_LLMAPI,
        "group",
        needs_data=True,
        weight_bytes=0.5,
        groupwise=True,
        group_sizes={"engine": (128,)},
        tensor_cores="FP8",
        fp8_context_fmha=True,
        moe=("llmapi",),
        moe_why={
            "engine": "TensorRT-LLM 1.2's MoE layer takes W4A8 experts' group scales interleaved with a "
            "per-expert alpha, which its checkpoint preprocessing (preprocess_perlayer_weights) "
            "does not produce from per-linear W4A8 tensors, NVIDIA/TensorRT-LLM@c388fec7 "
            "tensorrt_llm/layers/moe.py MOEWeightWrapper"
        },
        perf="w4a8",
        peak="tflops_fp8",
        advise=4,
    ),
    Scheme(
        "NVFP4",
        "nvfp4",
        ("llmapi",),
        "group",
        needs_data=True,
        weight_bytes=0.5 + 1 / 16,
        block=16,
        tensor_cores="FP4",
        fp8_context_fmha=True,
        moe=("llmapi",),
        perf="fp4",
        peak="tflops_fp4",
        advise=2,
        moe_why={
            "engine": "trtpipe has no engine writer for NVFP4 experts (TensorRT-LLM's MoE layer reads them "
            "stacked [E, out, in/2] with per-expert block scales, their interleaved copy and an [E] "
            "alpha, tensorrt_llm/layers/moe.py MOEWeightWrapper, revision not pinned to 1.2); use "
            "target: llmapi"
        },
        hf_config_groups={"group_0": {"input_activations": FP4_BLOCK, "weights": FP4_BLOCK, "targets": ["Linear"]}},
    ),
    # met only in pre-quantized sources and the builder's rules
    Scheme("FP8_BLOCK_SCALES", scale="group", tensor_cores="FP8", perf="fp8", peak="tflops_fp8"),  # FP8 GEMMs
    Scheme("W8A16_GPTQ", scale="group", groupwise=True, blackwell_dc="weight-only"),
    Scheme("W8A8_SQ_PER_TENSOR_PLUGIN", blackwell_dc="SmoothQuant"),
    Scheme("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", blackwell_dc="SmoothQuant", moe_why={"engine": NO_SQ_EXPERTS}),
    Scheme("W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", blackwell_dc="SmoothQuant"),
    Scheme("W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN", blackwell_dc="SmoothQuant"),
    Scheme("W4A16", weight_bytes=0.5, blackwell_dc="weight-only"),
    Scheme(
        "W4A16_GPTQ",
        scale="group",
        weight_bytes=0.5,
        groupwise=True,
        group_sizes={"engine": (64, 128)},
        blackwell_dc="weight-only",
    ),
    # E2M1 pairs + one E8M0 byte per 32 (gpt-oss experts as shipped)
    Scheme("W4A16_MXFP4", scale="group", weight_bytes=0.5 + 1 / 32, block=32),
)

BY_RECIPE: dict[str, Scheme] = {s.recipe: s for s in SCHEMES if s.recipe}
RECIPE_ALGOS: tuple[str, ...] = ("none", *BY_RECIPE)
# quant_algo -> its facts (several recipe algos share one quant_algo: the first row speaks for it)
BY_QUANT_ALGO: dict[str, Scheme] = {s.quant_algo: s for s in reversed(SCHEMES)}


def recipe_scheme(algo: str) -> Optional[Scheme]:
    """The row of a recipe's ``quantization.algo`` (None for ``none``)."""
    return BY_RECIPE.get(algo)


def needs_calibration_data(algo: str, kv_cache: str) -> bool:
    """Whether quantizing with recipe ``algo`` and ``kv_cache`` calibrates (validate and the quantize stage ask
    this one question)."""
    s = BY_RECIPE.get(algo)
    return (s is not None and s.needs_data) or kv_cache != "none"


def written_for(target: str, moe: bool = False) -> tuple[str, ...]:
    """The recipe algos ``target``'s writer writes (for a mixture-of-experts model: those whose experts it writes),
    in table order."""
    return tuple(s.recipe for s in BY_RECIPE.values() if target in (s.moe if moe else s.targets))


def quant_algos(pred) -> tuple[str, ...]:
    """The TensorRT-LLM quant_algos whose row satisfies ``pred`` (each once, in table order)."""
    return tuple(dict.fromkeys(s.quant_algo for s in SCHEMES if pred(s)))


def tensor_core_rejection(sm: int, quant_algo: Optional[str]) -> Optional[str]:
    """Why a GPU of compute capability ``sm`` cannot run ``quant_algo``'s GEMMs (its row's tensor cores), or None."""
    s = BY_QUANT_ALGO.get(quant_algo) if quant_algo else None
    if s is None or sm >= s.min_sm:
        return None
    tc = TENSOR_CORES[s.tensor_cores]
    return (
        f"{quant_algo} needs {tc.name} tensor cores (SM >= {tc.min_sm // 10}.{tc.min_sm % 10}{tc.note}); "
        f"the target is SM {sm // 10}.{sm % 10}{tc.why}"
    )


@dataclass(frozen=True)
class KVScheme:
    """One KV-cache quantization.

    Attributes:
        kv_cache_quant_algo: TensorRT-LLM ``kv_cache_quant_algo`` (and the unified-HF name).
        recipe: the recipe's ``quantization.kv_cache`` (None: met only in sources).
        fmt: the primitives format of the cache (:mod:`trtpipe.formats.primitives`).
        bytes: bytes per cached element.
        min_scale: ModelOpt clamps FP8 KV scales to >= 1.0 (``clamp_fp8_scales``).
        perf: the performance model's KV dtype.
        llmapi: TensorRT-LLM's PyTorch backend loads a pre-quantized checkpoint with it.
    """

    kv_cache_quant_algo: str
    recipe: Optional[str]
    fmt: str
    bytes: float
    min_scale: float = 0.0
    perf: Optional[str] = None
    llmapi: bool = True


KV_SCHEMES: tuple[KVScheme, ...] = (
    KVScheme("FP8", "fp8", "fp8", 1, 1.0, perf="fp8"),
    KVScheme("INT8", "int8", "int8", 1, perf="int8", llmapi=False),
    KVScheme("NVFP4", None, "nvfp4", 0.5 + 1 / 16),
)
KV_BY_RECIPE: dict[str, KVScheme] = {k.recipe: k for k in KV_SCHEMES if k.recipe}
KV_BY_QUANT_ALGO: dict[str, KVScheme] = {k.kv_cache_quant_algo: k for k in KV_SCHEMES}
RECIPE_KV: tuple[str, ...] = ("none", *KV_BY_RECIPE)
