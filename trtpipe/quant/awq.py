"""Activation-aware weight quantization (AWQ, the "lite" grid search ModelOpt uses by default).

For each group of linears that read one input: with ``s = mean|x|^a / mean|W_norm|^(1-a)`` (normalized so that
``sqrt(max(s) min(s)) = 1``), pick the ``a`` in ``0, 0.1, ..., 1`` that minimizes the output error
``|| x W^T - (x / s) Q(W s)^T ||^2`` on calibration samples. The pre-quant scale stored in the checkpoint is
``pqs = 1 / s`` (the runtime computes ``x * pqs``), and the weight quantized is ``W / pqs``.
"""

from __future__ import annotations

import torch

from trtpipe.formats.primitives import choose_qparams, dequantize, observe_amax, quantize


def int4_roundtrip(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-wise symmetric int4 quantize-dequantize (round to nearest), float32."""
    scale = choose_qparams(observe_amax(w, group_size), "int4")
    return dequantize(quantize(w, scale, "int4", group_size), scale, "int4", group_size)


def weight_mean(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean over output rows of ``|W|`` normalized by its group amax: ``[in]``."""
    w = w.float()
    amax = observe_amax(w, group_size).repeat_interleave(group_size, dim=-1).clamp_min(1e-12)
    return (w.abs() / amax).mean(dim=0)


def awq_scales(
    samples: torch.Tensor,
    act_mean: torch.Tensor,
    weights: list[torch.Tensor],
    group_size: int,
    grid: int = 10,
) -> tuple[torch.Tensor, float]:
    """Search the AWQ pre-quant scale of one input group.

    Args:
        samples: ``[N, in]`` calibration inputs of the group (a subsample of tokens is enough).
        act_mean: ``[in]`` mean absolute input over all calibration tokens.
        weights: the ``[out_k, in]`` weights that read this input.
        group_size: int4 group size.
        grid: number of alpha steps in [0, 1].

    Returns:
        ``(pqs [in] float32, best alpha)``.
    """
    w = torch.cat([x.float() for x in weights])  # [out, in]
    x = samples.float()
    ref = x @ w.T
    w_mean = weight_mean(w, group_size)
    best, best_loss, best_alpha = torch.ones_like(act_mean, dtype=torch.float32), float("inf"), 0.0
    for step in range(grid + 1):
        alpha = step / grid
        s = act_mean.float().clamp_min(1e-4).pow(alpha) / w_mean.clamp_min(1e-4).pow(1 - alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(1e-4, 1e4)
        out = (x / s) @ int4_roundtrip(w * s, group_size).T
        loss = (out - ref).pow(2).mean().item()
        if loss < best_loss:
            best, best_loss, best_alpha = s, loss, alpha
    return 1.0 / best, best_alpha


CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 ... 0.5


def awq_clip(
    samples: torch.Tensor, w: torch.Tensor, group_size: int, ratios=CLIP_RATIOS, rows_per_chunk: int = 256
) -> torch.Tensor:
    """AWQ's weight-clipping search: per (output row, group) the clipped amax minimizing the error of that
    group's partial dot products on the samples, ``mean_n (x_ng . (w_og - Q(w_og)))^2``.

    Args:
        samples: ``[N, in]`` inputs as the quantized weight sees them (pre-quant scale applied).
        w: ``[out, in]`` the weight to quantize (``W / pqs``).

    Returns:
        ``[out, in/g]`` float32 amax to take the int4 scales from (amax/7).
    """
    x = samples.float()
    n, d = x.shape
    xg = x.view(n, d // group_size, group_size)  # [N, G, g]
    out = []
    for w_chunk in w.float().split(rows_per_chunk, dim=0):
        wg = w_chunk.view(w_chunk.shape[0], d // group_size, group_size)  # [o, G, g]
        amax0 = wg.abs().amax(-1)  # [o, G]
        best_err = torch.full_like(amax0, float("inf"))
        best = amax0.clone()
        for r in ratios:
            amax = (amax0 * r).clamp_min(1e-12)
            s = (amax / 7.0).unsqueeze(-1)
            dq = (wg / s).round().clamp(-8, 7) * s
            err = torch.einsum("ngk,ogk->ngo", xg, wg - dq).pow(2).mean(0).T  # [o, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, amax, best)
        out.append(best)
    return torch.cat(out)


def expert_awq(
    samples: list,
    act_mean: list,
    weights: list[torch.Tensor],
    group_size: int,
    round_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """AWQ of one MoE linear's experts, each searched on the tokens the router sent to it.

    The experts of a layer then share one pre-quant scale, the mean of the searched ones, as ModelOpt's unified
    export writes them (``preprocess_linear_fusion(experts, resmooth_only=True)``: the mean over experts) and as
    TensorRT-LLM's MoE plugin reads them (one ``prequant_scaling_factor`` row for all experts); each expert's weight
    is then clipped for that shared scale on its own samples.

    Fallback, for an expert no calibration token reached (``samples[e]`` None): it adds nothing to the mean and its
    weights get plain per-group max-abs scales (round to nearest, as ``int4_wo``) for the shared pre-quant scale;
    when no expert saw a token the shared scale is 1 (plain ``int4_wo``). Never a zero or infinite scale: every
    searched scale is clamped to [1e-4, 1e4] before the mean.

    Args:
        samples: per expert, ``[N_e, in]`` routed inputs (a subsample), or None for an expert that saw none.
        act_mean: per expert, ``[in]`` mean |x| over its routed tokens (None with ``samples[e]`` None).
        weights: the ``[E, out_k, in]`` stacked weights that read this input (e.g. up and gate).
        round_dtype: the stored dtype of the pre-quant scale (the weight is divided by the rounded scale).

    Returns:
        ``(pqs [in] float32, per-expert [out, in/g] clipped amax of the concatenated weights, idle expert ids)``.
    """
    num_experts, in_features = weights[0].shape[0], weights[0].shape[-1]
    active = [e for e in range(num_experts) if samples[e] is not None and samples[e].shape[0] > 0]
    found = [awq_scales(samples[e], act_mean[e], [w[e] for w in weights], group_size)[0] for e in active]
    pqs = torch.stack(found).mean(0) if found else torch.ones(in_features)
    pqs = pqs.to(round_dtype).float()
    amax = []
    for e in range(num_experts):
        w = torch.cat([x[e].float() for x in weights]) / pqs
        amax.append(awq_clip(samples[e] * pqs, w, group_size) if e in active else observe_amax(w, group_size))
    return pqs, amax, [e for e in range(num_experts) if e not in active]
