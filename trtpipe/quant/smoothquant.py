"""SmoothQuant migration: per-input-channel scales that move activation outliers into the weights.

Convention (ModelOpt / TRT-LLM ``W8A8_SQ_PER_CHANNEL``): the runtime multiplies the activation by the pre-quant
scale, ``x' = x * pqs``, and the stored weight is ``W / pqs`` (so ``W ~= q * wsf[:, None] * pqs[None, :]``).
Linears that read the same input (q/k/v, fc/gate) get one scale computed from all their weights at once.
"""

from __future__ import annotations

import torch


def smooth_scales(act_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Pre-quant scale ``pqs = max|W|_j^(1-alpha) / max|x|_j^alpha`` per input channel j (float32 ``[in]``).

    Args:
        act_amax: ``[in]`` per-channel absolute maximum of the input seen in calibration.
        weights: the ``[out_k, in]`` weights of every linear that reads this input.
        alpha: migration strength (0: nothing moves, 1: activations normalized to 1).
    """
    w_amax = torch.cat([w.float() for w in weights]).abs().amax(dim=0)  # [in]
    a = act_amax.float()
    pqs = w_amax.pow(1 - alpha) / a.pow(alpha)
    dead = (a <= 2.0**-31) | (w_amax <= 2.0**-31) | ~torch.isfinite(pqs)
    return torch.where(dead, torch.ones_like(pqs), pqs).clamp(1e-4, 1e4)


def smoothed_act_amax(act_amax: torch.Tensor, pqs: torch.Tensor) -> torch.Tensor:
    """Per-tensor amax ``[1]`` of ``x * pqs``, exact from per-channel amax because pqs > 0."""
    return (act_amax.float() * pqs.float()).amax().reshape(1)
