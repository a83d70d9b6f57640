"""Canonical (ModelOpt unified) projections -> the TensorRT-LLM checkpoint's fused linears, for ``trtllm-build``.

The checkpoint converter (:func:`trtpipe.checkpoint.convert.convert`) asks an :class:`ImportedLinears` for every
quantized linear of a layer instead of reading float weights; the tensors it returns are unsharded, in TensorRT-LLM
names, and are sharded and streamed exactly as float ones are. Fusion follows ModelOpt's TensorRT-LLM export
(``preprocess_linear_fusion``): q/k/v and gate/up each become one linear; per-tensor FP8 weight scales become the
members' max and members with a smaller scale are requantized to it (one FP8 rounding: a lossy step the recipe
must accept, as is zero-point INT4's ``zero`` rounded to the model dtype; :mod:`.lossy`);
input scales take the max; per-row and per-group scales are concatenated with their rows; scales that must be one
per fused linear (W4A8's ``input_scale`` / ``weight_scale_2``, SmoothQuant's pre-quant scale) must be equal or
the checkpoint is refused. AWQ's pre-quant scale of q/k/v and gate/up is folded into the norm in the unified
format, so those linears get unit ``prequant_scaling_factor`` (TensorRT-LLM's W4A16_AWQ layer reads one on every
linear); o_proj / down_proj keep theirs. Renames: ``weight_scale -> weights_scaling_factor`` (FP8 per channel:
``per_channel_scale``), ``input_scale -> activation_scaling_factor``, ``weight_scale_2 -> weights_scaling_factor_2``,
``pre_quant_scale -> prequant_scaling_factor``; FP8 KV ``k_scale`` / ``v_scale`` -> ``attention.{k,v,kv}_cache_
scaling_factor``, clamped to >= 1 as trtpipe's own writer and ModelOpt's TensorRT-LLM export do.

INT8 W8A8 (per-channel weights, dynamic per-token activations) becomes TensorRT-LLM's plugin SmoothQuant layout,
``W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN``, as the legacy Llama converter writes it (``get_tllm_linear_sq_weight``
with ``per_token`` and ``per_channel``, ``tensorrt_llm/models/llama/convert.py``, NVIDIA/TensorRT-LLM@04a2cacb), for
the layers ``smooth_quantize_plugin`` swaps in (``tensorrt_llm/quantization/quantize.py``, NVIDIA/TensorRT-LLM@06148676;
``SmoothQuantLinear`` / ``SmoothQuantRowLinear`` / ``SmoothQuantRmsNorm``, ``tensorrt_llm/quantization/layers.py``,
NVIDIA/TensorRT-LLM@027cd518):

* ``<linear>.weight``: the INT8 codes ``[out, in]`` as stored (q/k/v and fc/gate concatenated along the outputs);
* ``<linear>.per_channel_scale``: F32 ``[1, out]``, the weight's dequantization scale per output column (the
  source's ``weight_scale``, ``amax / 127``): with per-token activations the GEMM plugin computes
  ``y = (x_q @ W_q^T) * per_token_scale * per_channel_scale``;
* ``attention.dense.smoother`` / ``mlp.proj.smoother``: F32 ``[1, in]``, the divisor applied to the input before
  ``quantize_per_token``; ones, because the producer folded any smoothing into the weights and norms already;
* ``input_layernorm.scale_to_int`` / ``post_layernorm.scale_to_int``: ``[1]`` = 1.0 in the model dtype (the dtype
  ``SmoothQuantRmsNorm`` declares; the legacy converter writes float32 1.0 when there is no smoother), the norm
  plugin's static scale, which per-token quantization does not use for its dynamic scales.

No ``act_scale`` / ``quantization_scaling_factor`` (static activation scaling only). ``smooth_quantize_plugin``
replaces every Attention / GatedMLP / RmsNorm but ``ln_f`` whatever ``exclude_modules`` says, so a checkpoint that
leaves a decoder linear unquantized is refused; and ``SmoothQuantLinear`` / ``SmoothQuantRowLinear`` assert that
each rank's ``in_features`` is a multiple of 4 (they view the INT8 weight as float32), so a tp that breaks that
is refused. Not confirmed here: how 1.2's ``load()`` reinterprets the INT8 ``[out, in]`` weight into the layer's
float32 ``[out, in/4]`` parameter (the legacy converter writes INT8 ``[out, in]``, which is what this writes).

NVFP4 (dense linears; ModelOpt's unified checkpoint): the same four tensors per linear as ModelOpt's TensorRT-LLM
export writes (``weight`` U8 [out, in/2], two E2M1 codes a byte, low nibble the even column; ``weights_scaling_factor``
F8_E4M3 [out, in/16], the block scales; ``weights_scaling_factor_2`` and ``activation_scaling_factor`` F32 [1], the
global weight and input scales), codes and scales copied as stored (q/k/v concatenated along the outputs, the block
scales with their rows). TensorRT-LLM 1.2.0rc2's ``preprocess_perlayer_weights``
(``tensorrt_llm/models/modeling_utils.py``, NVIDIA/TensorRT-LLM@b35ac1b6) renames them into ``FP4Linear``'s
parameters and derives the rest itself (``weights_block_scaling_factor_interleaved`` by ``block_scale_interleave``,
padded to [pad128(out), pad4(in/16)]; ``alpha = activation_scaling_factor * weights_scaling_factor_2``). FP4Linear
keeps one global weight scale and one input scale per linear, so q/k/v must share them (ModelOpt's export does, by
``preprocess_linear_fusion``); a source whose fused members differ is refused (:func:`nvfp4_unshared_why`): sharing
them would requantize the codes. mlp.fc / mlp.gate are separate FP4 linears (``fuse_gate_mlp`` fuses FP8 only).
Sharding is the generic one: a row-parallel rank takes whole 16-blocks of inputs (validate's whole-groups rule, group
16). The FP4 GEMM needs SM >= 10.0 (Blackwell); validate refuses an NVFP4 engine recipe on an older ``engine.gpu``.

Mixture-of-experts layers (ModelOpt FP8 per tensor, and symmetric INT4 without pre-quant scales; :func:`moe_refusal`
says why not the others): each FP8
expert's up and gate are fused as a dense gate/up is (:func:`_fp8_shared`: their max scale, the other requantized),
then stacked as trtpipe's own FP8 MoE checkpoint and TensorRT-LLM 1.2's MoE layer lay them out
(NVIDIA/TensorRT-LLM@c388fec7 ``tensorrt_llm/layers/moe.py`` ``MOEWeightWrapper.postprocess``, which requantizes
w3/w1 the same way): ``mlp.fc.weight`` F8 [E, 2I, H] (the family rule's source order, up first),
``mlp.fc.weights_scaling_factor`` F32 [E, 1], ``mlp.proj.weight`` [E, H, I] with its own [E, 1], and one
``activation_scaling_factor`` [1] per linear, the max over the experts' input scales (the plugin has one). The
stacked weights stream to each rank part by part (:class:`trtpipe.checkpoint.experts.ExpertParts`): down_proj from
the file's pages, each expert's fused up/gate from one copy per layer. INT4 experts without pre-quant scales
(compressed-tensors W4A16 and GPTQ without act-order, symmetric or with zero points) take the engine's INT4 AWQ
expert layout (:mod:`trtpipe.checkpoint.quant_layouts`): each expert's canonical codes (two output rows per byte)
and group scales stacked as ``mlp.fc.weight`` I8 [E, I, H] (up rows, then gate rows) with F32 [E, 2I, H/g] scales,
``mlp.proj`` [E, H/2, I] / [E, H, I/g], and the one ``prequant_scaling_factor`` per linear the MoE layer reads for
all experts, ones ([H] / [I], model dtype). Zero points become the MoE layer's own groupwise ``zero`` [E, in/g, out]
in the model dtype (``MOEWeightWrapper`` declares it so when the config has ``has_zero_point``, and
``preprocess_perlayer_weights`` leaves it as written; NVIDIA/TensorRT-LLM@c388fec7 ``tensorrt_llm/layers/moe.py``,
@27712aa7 ``tensorrt_llm/models/modeling_utils.py``): each expert's members' :func:`zero_of`, up columns then gate
columns as upstream's own ``postprocess_awq`` concatenates them, so ``mlp.fc.zero`` [E, H/g, 2I] and
``mlp.proj.zero`` [E, I/g, H]. The kernel dequantizes as the dense one does, ``q * s + zero``
(``MmaTensorOpDequantizer``, NVIDIA/TensorRT-LLM@23bc5b7c ``cpp/tensorrt_llm/cutlass_extensions/include/
cutlass_extensions/gemm/warp/mma_tensorop_dequantizer.h``), and the rounding of ``zero`` to the model dtype is the
dense lossy step, ``zero_point_rounding``. :data:`MOE_STACK` holds the per-algorithm stacking.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Callable, Iterator, Optional

import torch

from trtpipe.checkpoint.experts import ExpertParts
from trtpipe.checkpoint.quant_layouts import LINEARS, STYLE, exclude_modules
from trtpipe.formats.primitives import dequantize, quantize
from trtpipe.formats.schemes import BY_QUANT_ALGO
from trtpipe.errors import CheckpointError
from trtpipe.models.family import Rule, shape_symbols
from trtpipe.quant.imported import awq, compressed, gptq, lossy, others
from trtpipe.quant.imported.canonical import check_projection
from trtpipe.quant.imported.formats import ImportedFormat

LAYER = "transformer.layers.{}."
MODEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_MIN_SCALE = 1.0
REQUANT_BYTES = 32 << 20
WEIGHT_KEYS = ("weight", "weight_packed", "qweight")  # where each family stores a projection's codes

# family -> fn(fmt, tensors by suffix, module, where, out, in) -> canonical tensors (ModelOpt unified)
CANONICAL: dict[str, Callable] = {
    "modelopt": lambda fmt, t, module, where, out_f, in_f: t,
    "compressed-tensors": compressed.canonical,
    "gptq": gptq.canonical,
    "awq": awq.canonical,
    "fbgemm_fp8": others.fbgemm_canonical,
}
# family -> where the FP8 KV scales of a layer live (relative to the HF layer prefix)
KV_NAMES: dict[str, tuple[str, str]] = {
    "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "compressed-tensors": ("self_attn.k_scale", "self_attn.v_scale"),
}


def _meta(ts: list[torch.Tensor]) -> bool:
    return ts[0].device.type == "meta"


def _same(ts: list[torch.Tensor], what: str) -> torch.Tensor:
    if not _meta(ts) and any(not torch.equal(ts[0].float(), t.float()) for t in ts[1:]):
        raise CheckpointError(
            f"{what} differ between the projections fused into one linear; TensorRT-LLM keeps one per fused linear"
        )
    return ts[0]


def requantize_fp8(q: torch.Tensor, s_from: torch.Tensor, s_to: torch.Tensor) -> torch.Tensor:
    """FP8 codes of scale ``s_from`` re-expressed at ``s_to``, a block of rows at a time (float32 temporaries of
    REQUANT_BYTES, not of the whole weight: a 70B gate_proj would need 1 GB of them at once)."""
    out = torch.empty_like(q)
    step = max(1, REQUANT_BYTES // (4 * max(1, q[0].numel())))
    for r in range(0, q.shape[0], step):
        out[r : r + step] = quantize(dequantize(q[r : r + step], s_from, "fp8", "tensor"), s_to, "fp8", "tensor")
    return out


def _fp8_shared(ms: list[dict], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused codes, shared scale [1]): members requantized to the max of their per-tensor scales. One member is
    returned as is (a view of the file, which the writer streams)."""
    scales = [m["weight_scale"].float().reshape(1) for m in ms]
    if _meta([m["weight"] for m in ms]):
        return _cat(ms, "weight"), torch.empty(1, device="meta")
    s = torch.stack(scales).amax(0)
    codes = [m["weight"] if torch.equal(sm, s) else requantize_fp8(m["weight"], sm, s) for m, sm in zip(ms, scales)]
    return (torch.cat(codes) if len(codes) > 1 else codes[0]), s


def _stack_meta(ts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Per-expert scalars stacked to ``shape`` in float32 (a meta tensor when they are)."""
    return torch.empty(shape, device="meta") if _meta(ts) else torch.stack(ts).float().reshape(shape)


def _amax1(ms: list[dict], key: str) -> torch.Tensor:
    ts = [m[key].float().reshape(1) for m in ms]
    return torch.empty(1, device="meta") if _meta(ts) else torch.stack(ts).amax(0)


def _cat(ms: list[dict], key: str, shape=None) -> torch.Tensor:
    ts = [m[key] if shape is None else m[key].reshape(shape) for m in ms]
    return torch.cat(ts) if len(ts) > 1 else ts[0]


def _prequant(ms: list[dict], in_f: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    present = [m["pre_quant_scale"] for m in ms if "pre_quant_scale" in m]
    if present and len(present) != len(ms):
        raise CheckpointError(f"{what}: pre_quant_scale is on some of the fused projections only")
    if not present:
        return torch.ones(in_f, dtype=dtype, device=ms[0]["weight"].device)
    return _same(present, f"{what}: pre_quant_scale").to(dtype)


def _fp8(ms, in_f, dtype, what):
    w, s = _fp8_shared(ms, what)
    return {"weight": w, "weights_scaling_factor": s.float(), "activation_scaling_factor": _amax1(ms, "input_scale")}


def _fp8_rowwise(ms, in_f, dtype, what):
    return {"weight": _cat(ms, "weight"), "per_channel_scale": _cat(ms, "weight_scale", (-1,)).float()}


def _w8a16(ms, in_f, dtype, what):
    return {"weight": _cat(ms, "weight"), "weights_scaling_factor": _cat(ms, "weight_scale", (-1,)).float()}


def _sq(ms, in_f, dtype, what):
    return {
        **_w8a16(ms, in_f, dtype, what),
        "prequant_scaling_factor": _prequant(ms, in_f, dtype, what),
        "activation_scaling_factor": _amax1(ms, "input_scale"),
    }


def _sq_per_token(ms, in_f, dtype, what):
    return {"weight": _cat(ms, "weight"), "per_channel_scale": _cat(ms, "weight_scale", (-1,)).float().reshape(1, -1)}


def sq_plugin_extras(linear: str, in_f: int, dtype: torch.dtype, meta: bool) -> dict[str, torch.Tensor]:
    """The plugin SmoothQuant layer tensors that belong to no source projection, by name relative to the layer:
    a row linear's unit ``smoother`` [1, in], the unit ``scale_to_int`` of the norm a linear group reads."""
    make = (
        (lambda shape, dt: torch.empty(shape, dtype=dt, device="meta"))
        if meta
        else (lambda shape, dt: torch.ones(shape, dtype=dt))
    )
    out = {}
    if STYLE[linear] == "row":
        out[f"{linear}.smoother"] = make((1, in_f), torch.float32)
    if linear in NORM_OF:
        out[f"{NORM_OF[linear]}.scale_to_int"] = make((1,), dtype)
    return out


# the norm whose (quantizing) plugin feeds a linear group, named once per group
NORM_OF = {"attention.qkv": "input_layernorm", "mlp.fc": "post_layernorm"}
SQ_ROW_ALIGN = 4  # SmoothQuantLinear / SmoothQuantRowLinear: assert in_features % 4 == 0 (per rank)


def sq_misaligned(linear: str, in_f: int, tp: int) -> Optional[str]:
    """Why a plugin SmoothQuant linear (TensorRT-LLM name, e.g. ``mlp.proj``) of ``in_f`` input features cannot be
    built at ``tp`` (each rank's in_features must be a multiple of SQ_ROW_ALIGN; row linears split them), or None."""
    per_rank = in_f // tp if STYLE[linear] == "row" else in_f
    if per_rank % SQ_ROW_ALIGN == 0:
        return None
    return (
        f"has {per_rank} input features per rank at tp {tp}; TensorRT-LLM's SmoothQuant plugin linears need a "
        f"multiple of {SQ_ROW_ALIGN} (use another tp)"
    )


def zero_of(zero_point: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TensorRT-LLM's groupwise ``zero`` ``[in/g, out]`` in the model dtype from canonical ``zero_point`` and
    ``weight_scale`` ``[out, in/g]``: the kernel computes ``W = q * s + zero``, so ``zero = -zero_point * s``
    (upstream: ``(-qzeros + 8) * scales``). Computed in float64, rounded once to ``dtype`` (exact in float32)."""
    if zero_point.device.type == "meta":
        return torch.empty(zero_point.shape[::-1], dtype=dtype, device="meta")
    return (-zero_point.double() * scale.double()).to(dtype).t().contiguous()


def _awq(ms, in_f, dtype, what):
    out = {
        "weight": _cat(ms, "weight").view(torch.int8),
        "weights_scaling_factor": _cat(ms, "weight_scale").float(),
        "prequant_scaling_factor": _prequant(ms, in_f, dtype, what),
    }
    zps = [m.get("zero_point") for m in ms]
    if any(z is not None for z in zps):
        if any(z is None for z in zps):
            raise CheckpointError(f"{what}: zero_point is on some of the fused projections only")
        out["zero"] = torch.cat([zero_of(z, m["weight_scale"], dtype) for z, m in zip(zps, ms)], dim=1)
    return out


def _w4a8(ms, in_f, dtype, what):
    out = _awq(ms, in_f, dtype, what)
    for src, dst in (("input_scale", "activation_scaling_factor"), ("weight_scale_2", "weights_scaling_factor_2")):
        out[dst] = _same([m[src].float().reshape(1) for m in ms], f"{what}: {src}")
    return out


# NVFP4's per-tensor scales of which TensorRT-LLM's FP4Linear keeps one per fused linear: source suffix -> engine suffix
NVFP4_SHARED = (("weight_scale_2", "weights_scaling_factor_2"), ("input_scale", "activation_scaling_factor"))


def _nvfp4(ms, in_f, dtype, what):
    """NVFP4 as ModelOpt's TensorRT-LLM export writes it and ``preprocess_perlayer_weights`` reads it (TensorRT-LLM
    1.2.0rc2, ``tensorrt_llm/models/modeling_utils.py``@b35ac1b6): codes U8 [out, in/2] and FP8 block scales
    [out, in/16] as stored (q/k/v concatenated along the outputs), the global weight and input scales F32 [1],
    which the fused members must share (:func:`nvfp4_unshared_why`, checked before this runs). The loader derives
    ``weights_block_scaling_factor(_interleaved)``, ``weights_global_scaling_factor``,
    ``activation_global_scaling_factor`` and ``alpha = input_scale * weight_scale_2`` from these four."""
    out = {"weight": _cat(ms, "weight"), "weights_scaling_factor": _cat(ms, "weight_scale")}
    for src, dst in NVFP4_SHARED:
        out[dst] = _same([m[src].float().reshape(1) for m in ms], f"{what}: {src}")
    return out


def nvfp4_unshared_why(modules: list[str], members: list[dict], fused: str) -> Optional[str]:
    """Why NVFP4 members fused into one TensorRT-LLM linear cannot be converted exactly (their global weight or input
    scales differ; TensorRT-LLM keeps one of each per fused linear), or None. ``members``: each module's tensors by
    suffix (scalars only are read). Not a lossy step trtpipe offers: sharing a global weight scale re-rounds every
    FP8 block scale of the other members and their codes with them, a requantization of the weights."""
    if len(members) < 2:
        return None
    for src, _ in NVFP4_SHARED:
        values = [float(m[src].float().reshape(())) for m in members]
        if len(set(values)) > 1:
            parent, names = lossy.members_label(modules)
            listed = ", ".join(f"{v:.6g}" for v in values)
            return (
                f"{parent}: {names} {src} differ ({listed}); TensorRT-LLM's NVFP4 {fused} keeps one per fused "
                "linear and trtpipe does not requantize NVFP4 codes to share one; use a checkpoint whose fused "
                "projections share it (ModelOpt's export does) or target: llmapi"
            )
    return None


# canonical quant_algo -> fn(member tensors, in_features, model dtype, what) -> fused TRT-LLM tensors by suffix
FUSE: dict[str, Callable] = {
    "FP8": _fp8,
    "FP8_PER_CHANNEL_PER_TOKEN": _fp8_rowwise,
    "W8A16": _w8a16,
    "W8A8_SQ_PER_CHANNEL": _sq,
    "W4A16_AWQ": _awq,
    "W4A8_AWQ": _w4a8,
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": _sq_per_token,
    "NVFP4": _nvfp4,
}
GROUPWISE = tuple(a for a in FUSE if BY_QUANT_ALGO[a].groupwise)  # the scheme table's group-wise rows
# canonical quant_algo -> config.json ``quantization`` keys beside quant_algo / kv_cache_quant_algo (ModelOpt 0.47's
# process_layer_quant_config writes a fixed block (the scheme's) as group_size; TensorRT-LLM's FP4Linear has one)
CONFIG_EXTRAS: dict[str, dict] = {a: {"group_size": BY_QUANT_ALGO[a].block} for a in FUSE if BY_QUANT_ALGO[a].block}
# canonical quant_algo -> fn(TRT-LLM linear, in_features, model dtype, meta) -> the layer's tensors beside the linear's
EXTRAS: dict[str, Callable] = {"W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": sq_plugin_extras}
# algorithms whose TensorRT-LLM layers ignore exclude_modules (smooth_quantize_plugin): no decoder linear may be left out
NO_EXCLUDED_LINEARS = ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",)
# W4A16 experts: the engine layout (trtpipe.checkpoint.quant_layouts) has ONE pre-quant scale per linear for all
# experts. A source without pre-quant scales and without zero points maps onto it exactly (unit scale; codes and group
# scales copied); these are the other W4A16 sources, by why they are not converted.
MOE_INT4_PREQUANT = (
    "its experts carry per-expert pre_quant_scale (ModelOpt W4A16_AWQ); TensorRT-LLM 1.2's MoE layer "
    "reads one pre-quant scale for all the experts of a linear, so they would have to be resmoothed "
    "into one and requantized, which trtpipe does not do (it writes W4A16 AWQ experts from its own "
    "calibration: quantization.algo int4_awq on the unquantized model; or use a symmetric "
    "compressed-tensors / GPTQ W4A16 source, whose experts convert exactly)"
)
MOE_INT4_ZERO = (
    "its experts have zero points, and trtpipe converts zero-point INT4 experts from compressed-tensors "
    "W4A16 asymmetric and GPTQ sym: false checkpoints only (no AutoAWQ mixture-of-experts checkpoint "
    "was checked against its producer)"
)
MOE_INT4_ACT_ORDER = (
    "GPTQ act-order (desc_act: true) experts are not converted: whether each expert's g_idx is "
    "contiguous is known only from its tensors, and TensorRT-LLM's MoE kernels have no g_idx; "
    "re-quantize without desc_act"
)
# families whose symmetric W4A16 experts were checked against a producer's (or the format's) checkpoint
MOE_INT4_FAMILIES = ("compressed-tensors", "gptq")
# families whose zero-point W4A16 experts were (llm-compressor's asymmetric export; GPTQ sym: false packed from it)
MOE_INT4_ZERO_FAMILIES = ("compressed-tensors", "gptq")
# canonical quant_algo -> why its experts get no engine layout (FP8, W4A16_AWQ: see moe_refusal; absent: generic
# line): the scheme table's moe_why["engine"]
MOE_REFUSED: dict[str, str] = {
    a: BY_QUANT_ALGO[a].moe_why["engine"] for a in FUSE if "engine" in BY_QUANT_ALGO[a].moe_why
}
MOE_FAMILIES = ("modelopt",)  # sources whose FP8 experts were checked against their producer's checkpoint


# W4A16 sources whose experts do not map exactly onto the INT4 expert layout: (what the config says, why), first match
MOE_INT4_REFUSED: tuple[tuple[Callable[[ImportedFormat], bool], str], ...] = (
    (lambda f: bool(f.params.get("zero_point")) and f.family not in MOE_INT4_ZERO_FAMILIES, MOE_INT4_ZERO),  # AutoAWQ
    (lambda f: f.family == "modelopt", MOE_INT4_PREQUANT),
    (lambda f: bool(f.params.get("act_order")), MOE_INT4_ACT_ORDER),
    (
        lambda f: f.family not in MOE_INT4_FAMILIES,
        "trtpipe converts W4A16 mixture-of-experts layers from compressed-tensors and GPTQ checkpoints only",
    ),
)


def _int4_moe_refusal(fmt: ImportedFormat) -> Optional[str]:
    """Why a W4A16 source's experts do not map exactly onto the engine's INT4 expert layout (None: they do)."""
    return next((why for refuses, why in MOE_INT4_REFUSED if refuses(fmt)), None)


def moe_refusal(fmt: ImportedFormat) -> Optional[str]:
    """Why the experts of a mixture-of-experts source in format ``fmt`` are not converted for the engine target
    (None: they are, or the source has no quantized linears). Config only: ``trtpipe validate`` says the same."""
    if fmt.quant_algo is None or (fmt.quant_algo == "FP8" and fmt.family in MOE_FAMILIES):
        return None
    if fmt.quant_algo == "FP8":
        return (
            "trtpipe converts FP8 mixture-of-experts layers from ModelOpt unified checkpoints only "
            f"(no {fmt.family} MoE checkpoint was checked against its producer)"
        )
    if fmt.quant_algo == "W4A16_AWQ":
        return _int4_moe_refusal(fmt)
    return MOE_REFUSED.get(fmt.quant_algo, f"trtpipe has no engine layout for {fmt.quant_algo} experts")


def is_experts(rule: Rule) -> bool:
    return "experts" in rule.combine


def rule_modules(layer_prefix: str, rule: Rule, num_experts: int) -> list[str]:
    """The HF modules of a layer rule, per source (and, for experts, per expert within each source:
    ``[s * num_experts + e]``)."""
    experts = range(num_experts) if is_experts(rule) else (None,)
    return [layer_prefix + h[: -len(".weight")].format(e=e) for h in rule.hf for e in experts]


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module ``name`` is in an exclude list: exact names, fnmatch patterns (ModelOpt), ``re:`` regexes
    (compressed-tensors), a parent module, or a run of name components (transformers' ``modules_to_not_convert``
    entries such as ``lm_head`` or ``mlp``)."""
    return any(
        name == p
        or (p.startswith("re:") and re.fullmatch(p[3:], name))
        or (
            not p.startswith("re:")
            and (fnmatch.fnmatchcase(name, p) or name.startswith(p + ".") or f".{p}." in f".{name}.")
        )
        for p in patterns
    )


def module_index(keys) -> dict[str, dict[str, str]]:
    """HF module -> suffix -> full tensor name."""
    out: dict[str, dict[str, str]] = {}
    for k in keys:
        module, _, suffix = k.rpartition(".")
        out.setdefault(module, {})[suffix] = k
    return out


def _fp8_expert(members: list[dict], modules: list[str], what: str) -> tuple[list[torch.Tensor], dict]:
    """One FP8 expert: its up and gate share the max of their scales (the other requantized, as upstream's
    ``MOEWeightWrapper.postprocess`` does); its input scale the max of theirs."""
    codes, s = _fp8_shared(members, what)
    return list(codes.split([m["weight"].shape[0] for m in members])), {
        "s": s.reshape(1),
        "input": _amax1(members, "input_scale"),
    }


def _fp8_expert_scales(per_expert: list[dict], num: int, in_f: int, dtype, meta: bool) -> dict[str, torch.Tensor]:
    return {
        "weights_scaling_factor": _stack_meta([x["s"] for x in per_expert], (num, 1)),
        "activation_scaling_factor": _stack_meta([x["input"] for x in per_expert], (num, 1)).amax(0),
    }


def _int4_expert(members: list[dict], modules: list[str], what: str) -> tuple[list[torch.Tensor], dict]:
    """One INT4 expert: codes (two output rows per byte, as a dense W4A16 linear), group scales and zero points (all
    of its members or none) as the source's canonical tensors hold them. A per-expert pre-quant scale has no place in
    the layout (one unit pre-quant scale for all experts): refused naming the tensor (moe_refusal says it first)."""
    for m, module in zip(members, modules):
        if "pre_quant_scale" in m:
            raise CheckpointError(f"{what}: tensor '{module}' has a pre_quant_scale: {MOE_INT4_PREQUANT}")
    has = ["zero_point" in m for m in members]
    if any(has) and not all(has):
        raise CheckpointError(
            f"{what}: tensor '{modules[has.index(False)]}' has no zero_point and "
            f"'{modules[has.index(True)]}' has one; projections fused into one linear must be "
            "quantized alike"
        )
    extra = {"ws": [m["weight_scale"] for m in members]}
    if all(has):
        extra["zp"] = [m["zero_point"] for m in members]
    return [m["weight"].view(torch.int8) for m in members], extra


def _int4_expert_scales(per_expert: list[dict], num: int, in_f: int, dtype, meta: bool) -> dict[str, torch.Tensor]:
    """[E, out, in/g] F32 group scales (each expert's up rows then gate rows), the one unit pre-quant scale [in]
    shared by the experts (quant_layouts: SHARED_BY_EXPERTS) and, with zero points, the MoE layer's ``zero``
    [E, in/g, out] in the model dtype (each expert's members' :func:`zero_of` side by side along the outputs)."""
    members = range(len(per_expert[0]["ws"]))
    ws = torch.cat([torch.stack([x["ws"][i].float() for x in per_expert]) for i in members], dim=-2)
    pqs = torch.empty(in_f, dtype=dtype, device="meta") if meta else torch.ones(in_f, dtype=dtype)
    out = {"weights_scaling_factor": ws, "prequant_scaling_factor": pqs}
    if "zp" in per_expert[0]:  # every expert has them: each family's canonical() refuses zeros the config lacks
        out["zero"] = torch.stack(
            [torch.cat([zero_of(x["zp"][i], x["ws"][i], dtype) for i in members], dim=-1) for x in per_expert]
        )
    return out


# canonical quant_algo -> (fn(one expert's canonical members, their modules, what) -> (per-source weight pieces,
# per-expert extras), fn(extras of every expert, E, in_features, model dtype, meta) -> tensors beside the weight)
MOE_STACK: dict[str, tuple[Callable, Callable]] = {
    "FP8": (_fp8_expert, _fp8_expert_scales),
    "W4A16_AWQ": (_int4_expert, _int4_expert_scales),
}


class ImportedLinears:
    """The quantized linears of a pre-quantized source, as the checkpoint converter's linear source.

    Args:
        fmt: the detected format (its ``engine`` action must be ok).
        keys: every tensor name of the source (to find each projection's tensors).
        where: the source directory (for messages).
        allow_lossy: the :mod:`.lossy` steps the recipe accepts (``model.allow_lossy_import``); a step a layer
            needs that is not listed is refused before its tensors are fused (``trtpipe validate`` says so first).
    """

    def __init__(self, fmt: ImportedFormat, keys: list[str], where: str, allow_lossy: tuple[str, ...] = ()):
        if not fmt.engine.ok:
            raise CheckpointError(f"{where}: {fmt.describe()}: {fmt.engine.why}")
        if fmt.quant_algo is not None and fmt.quant_algo not in FUSE:
            raise CheckpointError(f"{where}: {fmt.quant_algo} has no TensorRT-LLM conversion")
        self.fmt, self.where, self.allow_lossy = fmt, where, tuple(allow_lossy)
        self.canonical = CANONICAL[fmt.family]
        self.modules = module_index(keys)
        self.excluded_trt: list[str] = []
        self._moe_excluded: dict[int, dict[str, bool]] = {}  # layer -> expert rule -> left unquantized

    def _hf_modules(self, plan, rule: Rule, layer: int) -> list[str]:
        return rule_modules(
            plan.info.weight_prefix + plan.family.hf_layer_prefix.format(layer), rule, plan.info.num_experts
        )

    def owns(self, plan, rule: Rule, layer: int) -> bool:
        """Whether this layer rule's tensor is a quantized linear this importer supplies."""
        if (
            self.fmt.quant_algo is None
            or not rule.trt.endswith(".weight")
            or rule.trt[: -len(".weight")] not in LINEARS
        ):
            return False
        if is_experts(rule) and moe_refusal(self.fmt):
            raise CheckpointError(
                f"{self.where}: {self.fmt.describe()}: mixture-of-experts layers are not converted "
                f"for the engine target: {moe_refusal(self.fmt)}"
            )
        if rule.combine not in ("one", "cat") and not is_experts(rule):
            raise CheckpointError(
                f"{self.where}: {self.fmt.describe()}: {rule.trt} ({rule.combine}) has no "
                "conversion for the engine target"
            )
        modules = self._hf_modules(plan, rule, layer)
        excluded = [matches(m, self.fmt.exclude) for m in modules]
        if any(excluded) and not all(excluded):
            raise CheckpointError(
                f"{self.where}: exclude_modules leaves {modules[excluded.index(False)]} quantized but "
                f"{modules[excluded.index(True)]} not; fused projections must be quantized alike"
            )
        if all(excluded) and self.fmt.quant_algo in NO_EXCLUDED_LINEARS:
            raise CheckpointError(
                f"{self.where}: {modules[0]} is left unquantized, but TensorRT-LLM's "
                f"{self.fmt.quant_algo} layers quantize every decoder linear (smooth_quantize_plugin "
                "ignores exclude_modules)"
            )
        if is_experts(rule):
            self._check_moe_alike(layer, rule, all(excluded))
        if all(excluded):
            name = LAYER.format(layer) + rule.trt[: -len(".weight")]
            # a MoE layer stays float only if its MixtureOfExperts module (``...mlp``) is named: TensorRT-LLM ignores
            # fc / proj there (NVIDIA/TensorRT-LLM@89fd9b74 tensorrt_llm/quantization/quantize.py quantize_layers)
            names = [name, LAYER.format(layer) + "mlp"] if is_experts(rule) else [name]
            self.excluded_trt.extend(n for n in names if n not in self.excluded_trt)
            return False
        return True

    def _check_moe_alike(self, layer: int, rule: Rule, excluded: bool) -> None:
        """A MoE layer is quantized as a whole in TensorRT-LLM: refuse a source whose up/gate experts are excluded
        and whose down experts are not (or the reverse), which no engine checkpoint can hold."""
        seen = self._moe_excluded.setdefault(layer, {})
        seen[rule.trt] = excluded
        if len(set(seen.values())) > 1:
            kept = next(t for t, x in seen.items() if not x).removesuffix(".weight")
            left = next(t for t, x in seen.items() if x).removesuffix(".weight")
            raise CheckpointError(
                f"{self.where}: layer {layer}: exclude_modules leaves the experts of {left} "
                f"unquantized but not those of {kept}; TensorRT-LLM quantizes a MoE layer as "
                "a whole (exclude all of its experts or none)"
            )

    def _tensors(self, reader, module: str, meta: bool, used: Optional[set]) -> dict[str, torch.Tensor]:
        names = self.modules.get(module, {})
        if used is not None:  # a bias is the family's (its own rule reads it) or, all zero, dropped by the importer
            used.update(n for s, n in names.items() if s != "bias")
        if "bias" in names and used is not None and not bool(reader.get(names["bias"]).any()):
            used.add(names["bias"])
        return {s: reader.meta(n) if meta else reader.get(n) for s, n in names.items()}

    def _canonical(self, reader, module: str, out_f: int, in_f: int, meta: bool, used: Optional[set]) -> tuple:
        """(canonical tensors of one projection, checked; the source tensors read)."""
        t = self._tensors(reader, module, meta, used)
        t = {k: v for k, v in t.items() if k not in ("k_scale", "v_scale")}
        c = self.canonical(self.fmt, t, module, self.where, out_f, in_f)
        check_projection(self.fmt.quant_algo, module, c, out_f, in_f, self.fmt.group_size, self.where)
        return c, list(t.values())

    def _experts(self, reader, plan, layer: int, rule: Rule, meta: bool, used: Optional[set], stream: bool):
        """A stacked expert linear: (name, weight or its ExpertParts, sources), then the tensors beside it
        (:data:`MOE_STACK`: the algorithm's per-expert fusion and how its scales stack)."""
        d = shape_symbols(plan.info)
        num = plan.info.num_experts
        dtype = MODEL_DTYPES[plan.dtype]
        fuse, scales_of = MOE_STACK[self.fmt.quant_algo]
        modules = self._hf_modules(plan, rule, layer)  # source-major: modules[s * num + e]
        trt = LAYER.format(layer) + rule.trt[: -len(".weight")]
        in_f = d[rule.shapes[0][1]]
        parts: list[list[torch.Tensor]] = [[] for _ in rule.hf]
        per_expert = []
        for e in range(num):
            members, raw = [], []
            for i, shape in enumerate(rule.shapes):
                c, r = self._canonical(reader, modules[i * num + e], d[shape[0]], d[shape[1]], meta, used)
                members.append(c)
                raw.extend(r)
            if not meta:
                self._check_lossy(
                    [modules[i * num + e] for i in range(len(rule.shapes))],
                    members,
                    f"{rule.trt[: -len('.weight')]} expert {e}",
                    plan.dtype,
                )
            pieces, extra = fuse(
                members, [modules[i * num + e] for i in range(len(members))], f"{self.where}: {trt} expert {e}"
            )
            for i, piece in enumerate(pieces):
                parts[i].append(piece)
            per_expert.append(extra)
            if not meta:  # sources copied (fused, unpacked) are read: drop their pages; views the writer streams stay
                kept = {p.data_ptr() for p in pieces}
                for v in raw:
                    if v.data_ptr() not in kept:
                        reader.drop_pages(v)
        names = [[self._weight_name(modules[i * num + e]) for e in range(num)] for i in range(len(rule.hf))]
        if meta:
            weight = torch.empty(
                num, sum(p[0].shape[0] for p in parts), parts[0][0].shape[1], dtype=parts[0][0].dtype, device="meta"
            )
        elif stream:
            weight = ExpertParts(tuple(map(tuple, parts)), tuple(map(tuple, names)))
        else:
            weight = torch.cat([torch.stack(p) for p in parts], dim=-2)
        yield f"{trt}.weight", weight, [n for group in names for n in group]
        flat = {n for group in names for n in group}
        sources = [n for m in modules for n in self.modules.get(m, {}).values() if n not in flat]
        for suffix, t in scales_of(per_expert, num, in_f, dtype, meta).items():
            yield f"{trt}.{suffix}", t, sources

    def _weight_name(self, module: str) -> str:
        """The source tensor holding a projection's codes (for messages): ``weight``, ``weight_packed`` (compressed-
        tensors) or ``qweight`` (GPTQ)."""
        names = self.modules.get(module, {})
        return next((names[k] for k in WEIGHT_KEYS if k in names), module)

    def layer_tensors(
        self, reader, plan, layer: int, rules: list[Rule], meta: bool, used: Optional[set], stream_experts: bool = False
    ) -> Iterator[tuple[str, torch.Tensor, list[str]]]:
        """(TRT-LLM name, unsharded tensor, source names) of the owned ``rules`` of ``layer`` and its KV scales;
        with ``stream_experts`` a stacked expert weight comes as its :class:`ExpertParts`."""
        d = shape_symbols(plan.info)
        dtype = MODEL_DTYPES[plan.dtype]
        for rule in rules:
            if is_experts(rule):
                yield from self._experts(reader, plan, layer, rule, meta, used, stream_experts)
                continue
            modules = self._hf_modules(plan, rule, layer)
            members, raw = [], []
            for module, shape in zip(modules, rule.shapes):
                out_f, in_f = d[shape[0]], d[shape[1]]
                c, r = self._canonical(reader, module, out_f, in_f, meta, used)
                raw.extend(r)
                members.append(c)
            trt = LAYER.format(layer) + rule.trt[: -len(".weight")]
            if not meta:
                self._check_lossy(modules, members, rule.trt[: -len(".weight")], plan.dtype)
            in_f = d[rule.shapes[0][1]]
            fused = FUSE[self.fmt.quant_algo](members, in_f, dtype, f"{self.where}: {trt}")
            extras = EXTRAS.get(self.fmt.quant_algo)
            if extras is not None:
                self._check_align(plan, rule, trt, in_f)
                for rel, t in extras(rule.trt[: -len(".weight")], in_f, dtype, meta).items():
                    yield LAYER.format(layer) + rel, t, []
            if not meta:  # sources copied into new tensors (fused, unpacked) are read: drop their mapped pages now;
                kept = {t.data_ptr() for t in fused.values()}  # views the writer streams drop their own pages
                for v in raw:
                    if v.data_ptr() not in kept:
                        reader.drop_pages(v)
            sources = [self.modules[m][s] for m in modules for s in self.modules.get(m, {})]
            for suffix, t in fused.items():
                yield f"{trt}.{suffix}", t, sources
        if self.fmt.kv_cache:
            yield from self._kv(reader, plan, layer, meta, used)

    def _check_lossy(self, modules: list[str], members: list[dict], fused: str, dtype: str) -> None:
        """Refuse a lossy step these members need and the recipe does not accept (the backstop of validate's)."""
        if self.fmt.quant_algo == "FP8" and len(members) > 1:
            scales = [float(m["weight_scale"].float().reshape(())) for m in members]
            lossy.require(
                lossy.FP8_REQUANTIZE, lossy.fp8_requantize_why(modules, scales, fused), self.allow_lossy, self.where
            )
        if self.fmt.quant_algo == "NVFP4":
            why = nvfp4_unshared_why(modules, members, fused)
            if why:
                raise CheckpointError(f"{self.where}: {why}")
        if any("zero_point" in m for m in members):
            why = lossy.zero_point_why(f"{self.fmt.family} {self.fmt.name}", dtype)
            lossy.require(lossy.ZERO_POINT_ROUNDING, why, self.allow_lossy, self.where)

    def _check_align(self, plan, rule: Rule, trt: str, in_f: int) -> None:
        why = sq_misaligned(rule.trt[: -len(".weight")], in_f, plan.layout.tp)
        if why:
            raise CheckpointError(f"{self.where}: {trt} {why}")

    def _kv(self, reader, plan, layer, meta, used):
        pre = plan.info.weight_prefix + plan.family.hf_layer_prefix.format(layer)
        names = [pre + n for n in KV_NAMES[self.fmt.family]]
        for n in names:
            if n not in reader:
                raise CheckpointError(f"{self.where}: tensor '{n}' is missing (kv cache {self.fmt.kv_cache})")
        if used is not None:
            used.update(names)
        if meta:
            k = v = torch.empty(1, device="meta")
        else:
            k, v = (reader.get(n).float().reshape(1).clamp_min(KV_MIN_SCALE) for n in names)
        base = LAYER.format(layer) + "attention."
        yield base + "k_cache_scaling_factor", k, names[:1]
        yield base + "v_cache_scaling_factor", v, names[1:]
        yield base + "kv_cache_scaling_factor", torch.empty(1, device="meta") if meta else torch.maximum(k, v), names

    def quantization(self) -> dict:
        """config.json ``quantization`` of the converted checkpoint (key order as ModelOpt writes it)."""
        return converted_quantization(self.fmt, self.excluded_trt)


def converted_quantization(f: ImportedFormat, excluded_trt: tuple[str, ...] | list[str] = ()) -> dict:
    """config.json ``quantization`` of the engine checkpoint converted from a source in format ``f``, with
    ``excluded_trt`` the TensorRT-LLM modules the source leaves unquantized (known once its tensors are read; the
    planner predicts the rest of the dict before that)."""
    q: dict = {"quant_algo": f.quant_algo, "kv_cache_quant_algo": f.kv_cache}
    if f.quant_algo in GROUPWISE:
        q.update(group_size=f.group_size, has_zero_point=bool(f.params.get("zero_point")), pre_quant_scale=True)
    q.update(CONFIG_EXTRAS.get(f.quant_algo, {}))
    if "clamp_val" in f.params:  # fbgemm's activation_scale_ub, as upstream's convert_checkpoint.py sets it
        q["clamp_val"] = f.params["clamp_val"]
    q["exclude_modules"] = exclude_modules(["lm_head", *excluded_trt])
    return q
