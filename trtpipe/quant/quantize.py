"""Quantize one decoder layer: calibration statistics + unsharded float weights -> per-rank checkpoint tensors.

Two passes, so tensor parallelism never changes a number:
1. :func:`layer_params` (unsharded): pre-quant scales (SmoothQuant / AWQ / unit), the weight to quantize
   ``W / pqs`` and every scale, with the shared-scale rules of :mod:`trtpipe.checkpoint.quant_layouts`.
2. :func:`rank_tensors`: split weights and scales with the same plan, then quantize and pack each rank's shard.
   Codes are elementwise given their scale, so ``quantize(shard(W), shard(s)) == shard(quantize(W, s))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from trtpipe.checkpoint.quant_layouts import (
    KV_ALGOS,
    LINEAR_GROUPS,
    SHARED_BY_EXPERTS,
    STYLE,
    TENSOR_DTYPES,
    Algo,
    group_granularity,
)
from trtpipe.formats.primitives import choose_qparams, observe_amax, pack_int4_rows, quantize
from trtpipe.checkpoint.shard import Layout, split_experts, split_linear_tensor
from trtpipe.errors import QuantizationError
from trtpipe.quant.awq import awq_scales
from trtpipe.quant.smoothquant import smooth_scales, smoothed_act_amax

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class GroupStats:
    """What calibration saw at one linear group's input (``[in]`` vectors, float32)."""

    amax: torch.Tensor  # per-channel max |x|
    absmean: Optional[torch.Tensor] = None  # per-channel mean |x| (AWQ)
    samples: Optional[torch.Tensor] = None  # [N, in] a subsample of input rows (AWQ search)
    awq_pqs: Optional[torch.Tensor] = None  # the AWQ search's result, when calibration already ran it
    awq_amax: dict = field(default_factory=dict)  # member linear -> [out, in/g] clipped amax (AWQ clip search)
    # MoE layers: [E] max |x| over the tokens routed to each expert (0: the expert saw no calibration token)
    expert_amax: Optional[torch.Tensor] = None
    # MoE layers: [E, in] per-channel max |x| of those tokens (W4A8: the amax of x * pqs, exact because pqs > 0)
    expert_channel_amax: Optional[torch.Tensor] = None

    def expert_input_amax(self) -> torch.Tensor:
        """[E] per-expert input amax for per-expert activation scales (the unified HF export's experts).

        Fallback, for an expert no calibration token was routed to: the amax of the whole MoE input (every token
        of the layer, ``amax``'s maximum), the scale the engine path shares across all experts. Never 0 (an infinite
        dequantization step) and never a guess from another expert alone.
        """
        if self.expert_amax is None:
            raise QuantizationError("calibration statistics have no per-expert amax (re-run calibration)")
        return torch.where(self.expert_amax > 0, self.expert_amax, self.amax.amax())

    def expert_smoothed_amax(self, pqs: torch.Tensor) -> torch.Tensor:
        """[E] per-expert amax of ``x * pqs`` (the input a W4A8 expert's FP8 quantizer sees after the pre-quant
        scale), from the tokens routed to each expert; an expert no token reached falls back as
        :meth:`expert_input_amax` does, to the whole MoE input's (``amax``) for the same ``pqs``."""
        if self.expert_channel_amax is None:
            raise QuantizationError("calibration statistics have no per-expert channel amax (re-run calibration)")
        own = (self.expert_channel_amax.float() * pqs.float()).amax(-1)
        return torch.where(own > 0, own, smoothed_act_amax(self.amax, pqs).reshape(()))


@dataclass
class LayerStats:
    groups: dict[str, GroupStats] = field(default_factory=dict)  # LINEAR_GROUPS key -> stats
    k_amax: Optional[torch.Tensor] = None  # [1] max |k| after rope
    v_amax: Optional[torch.Tensor] = None  # [1]


def layer_params(
    algo: Algo,
    weights: dict[str, torch.Tensor],
    stats: LayerStats,
    group_size: int,
    alpha: float,
    excluded: Callable[[str], bool],
    model_dtype: str = "float32",
) -> dict[str, dict[str, torch.Tensor]]:
    """Unsharded quantization parameters of one layer's linears.

    Args:
        weights: ``{linear name: [out, in] weight}`` (TRT-LLM names relative to the layer, e.g. ``mlp.fc``).
        excluded: linear name -> whether it stays unquantized (exclude_modules).
        model_dtype: the pre-quant scale is rounded to it first (it is stored so), then divides the weight.

    Returns:
        ``{linear: {"weight": W / pqs (float32), "weights_scaling_factor": ..., ["prequant_scaling_factor",
        "activation_scaling_factor", "weights_scaling_factor_2"]}}`` for every quantized linear.
    """
    gran = group_granularity(algo, group_size)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group, (members, _) in LINEAR_GROUPS.items():
        members = [m for m in members if m in weights and not excluded(m)]
        if not members:
            continue
        ws = [weights[m].float() for m in members]
        st = stats.groups.get(group) if stats is not None else None
        stacked = ws[0].dim() == 3
        if stacked and (gran == "channel" or (algo.prequant == "awq" and (st is None or st.awq_pqs is None))):
            # stacked experts [E, out, in]: per tensor (fp8, a scale per expert) or int4 per group with one pre-quant
            # scale shared by the experts (AWQ: the per-expert search calibration runs on the routed tokens)
            raise QuantizationError(
                f"{members[0]}: MoE experts take fp8 (per-expert scales), int4_wo, or int4_awq / "
                "w4a8_awq with AWQ statistics calibrated on the tokens routed to each expert "
                "(re-run calibration with the AWQ group size)"
            )
        pqs = _prequant(algo, ws, st, group_size, alpha)
        if pqs is not None:
            pqs = pqs.to(TORCH_DTYPES[model_dtype]).float()
        ws = [w / pqs if pqs is not None else w for w in ws]
        shared_amax = torch.stack([w.abs().amax() for w in ws]).amax().reshape(1)
        for m, w in zip(members, ws):
            if gran == "tensor" and w.dim() == 3:
                amax = observe_amax(w, "expert")  # [E, 1]: one scale per expert (trtllm-checkpoint.md)
            elif gran == "tensor":
                amax = shared_amax
            elif st is not None and m in st.awq_amax and algo.prequant == "awq":
                amax = st.awq_amax[m]  # clipped by the AWQ search, for this same W / pqs ([E, out, in/g] experts)
                if amax.shape != (*w.shape[:-1], w.shape[-1] // gran):
                    raise QuantizationError(
                        f"{m}: AWQ statistics were collected for another group size "
                        f"({list(amax.shape)} scales); re-run calibration for group_size {gran}"
                    )
            else:
                if gran not in ("tensor", "channel") and w.shape[-1] % gran:
                    raise QuantizationError(
                        f"{m}: in_features {w.shape[-1]} is not a multiple of group_size {gran} "
                        f"(add '*{m}' to quantization.exclude or pick another group_size)"
                    )
                amax = observe_amax(w, gran)
            p = {"weight": w, "weights_scaling_factor": choose_qparams(amax, algo.weight_fmt)}
            if pqs is not None:  # a copy: linears of one input (gate, fc) share pqs, and a float32 checkpoint keeps
                p["prequant_scaling_factor"] = pqs.clone()  # it as is (safetensors refuses tensors sharing memory)
            if algo.act_fmt and stacked and pqs is not None:  # W4A8 experts: each from its routed tokens
                p["activation_scaling_factor"] = choose_qparams(
                    st.expert_smoothed_amax(pqs).reshape(-1, 1), algo.act_fmt
                )
            elif algo.act_fmt:
                a = smoothed_act_amax(st.amax, pqs) if pqs is not None else st.amax.amax().reshape(1)
                p["activation_scaling_factor"] = choose_qparams(a, algo.act_fmt)
            if algo.weight_scale_2 and stacked:  # [E, 1]: each expert's, shared by its members (up and gate)
                p["weights_scaling_factor_2"] = choose_qparams(
                    torch.stack([observe_amax(v, "expert") for v in ws]).amax(0), "fp8"
                )
            elif algo.weight_scale_2:
                p["weights_scaling_factor_2"] = choose_qparams(shared_amax, "fp8")
            out[m] = p
    return out


def _prequant(
    algo: Algo, ws: list[torch.Tensor], st: Optional[GroupStats], group_size: int, alpha: float
) -> Optional[torch.Tensor]:
    if algo.prequant is None:
        return None
    if algo.prequant == "unit":
        return torch.ones(ws[0].shape[-1])
    if algo.prequant == "smooth":
        return smooth_scales(st.amax, ws, alpha)
    if st.awq_pqs is not None:
        return st.awq_pqs
    if st.samples is None:
        raise QuantizationError("AWQ needs calibration statistics collected for AWQ (re-run calibrate)")
    return awq_scales(st.samples, st.absmean, ws, group_size)[0]


def kv_scales(kv: str, stats: LayerStats) -> dict[str, torch.Tensor]:
    """``attention.{k,v,kv}_cache_scaling_factor`` [1] float32 (the kv one is the max of the two)."""
    a = KV_ALGOS[kv]
    k = choose_qparams(stats.k_amax.reshape(1), a.fmt).clamp_min(a.min_scale)
    v = choose_qparams(stats.v_amax.reshape(1), a.fmt).clamp_min(a.min_scale)
    return {
        "attention.k_cache_scaling_factor": k,
        "attention.v_cache_scaling_factor": v,
        "attention.kv_cache_scaling_factor": torch.maximum(k, v),
    }


# stacked experts: the tensors every expert of a layer shares (SHARED_BY_EXPERTS: [in], no expert axis, AWQ's
# pre-quant scale), and the tensors moe_tp splits like the weight (int4 group scales [E, out, in/g] with the rows or
# the groups, the pre-quant scale with the input; per-expert FP8 scales [E, 1] have no axis to split: tensor_axes
# leaves them whole)
SPLIT_WITH_EXPERT_WEIGHT = ("weight", "weights_scaling_factor", "prequant_scaling_factor")


def shard_params(
    name: str, p: dict[str, torch.Tensor], rank: int, layout: Layout, intermediate_size: int = 0
) -> dict[str, torch.Tensor]:
    """One rank's float weight and scales, split by the checkpoint's own plan (``checkpoint.shard``):
    per-tensor replicated, per-channel with the rows, groups like the weight, pre-quant scale with the input.
    Stacked experts: this rank's experts (moe_ep), then the weight's moe_tp slice ([w3; w1] halves for fc);
    per-expert scales follow the experts only."""
    style = "qkv" if name == "attention.qkv" else STYLE[name]
    if p["weight"].dim() != 3:
        return {k: split_linear_tensor(t, k, style, rank, layout, what=f"{name}.{k}") for k, t in p.items()}
    out = {}
    sections = (intermediate_size, intermediate_size) if style == "column" else ()
    num_local = layout.num_experts // layout.moe_ep
    for k, t in p.items():
        if k not in SHARED_BY_EXPERTS:
            t = split_experts(t, rank, layout, what=f"{name}.{k}")
        if k in SPLIT_WITH_EXPERT_WEIGHT:
            t = split_linear_tensor(t, k, style, rank, layout, sections=sections, experts=num_local, what=f"{name}.{k}")
        out[k] = t
    return out


def finalize(algo: Algo, p: dict[str, torch.Tensor], group_size: int, model_dtype: str) -> dict[str, torch.Tensor]:
    """Quantize and pack one rank's weight; cast every tensor to its stored dtype (layouts.TENSOR_DTYPES)."""
    gran = group_granularity(algo, group_size)
    if gran == "tensor" and p["weight"].dim() == 3:
        gran = "expert"
    q = quantize(p["weight"], p["weights_scaling_factor"], algo.weight_fmt, gran)
    if algo.weight_fmt == "int4":
        q = pack_int4_rows(q)
    out = {"weight": q.contiguous()}
    for key, t in p.items():
        if key == "weight":
            continue
        stored = TENSOR_DTYPES[key]
        dtype = TORCH_DTYPES[model_dtype if stored == "model" else stored]
        out[key] = t.to(dtype).contiguous()
    return out


def rank_tensors(
    algo: Algo,
    params: dict[str, dict[str, torch.Tensor]],
    rank: int,
    layout: Layout,
    group_size: int,
    model_dtype: str,
    intermediate_size: int = 0,
) -> dict[str, torch.Tensor]:
    """``{"<linear>.<suffix>": tensor}`` of one rank for every quantized linear of a layer."""
    out = {}
    for name, p in params.items():
        shard = shard_params(name, p, rank, layout, intermediate_size)
        for key, t in finalize(algo, shard, group_size, model_dtype).items():
            out[f"{name}.{key}"] = t
    return out
