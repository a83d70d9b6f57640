"""Multi-head latent attention (DeepSeek-V3) and its group-limited sigmoid routing, for the reference runtime.

The cache holds, per token and layer, only the normalized latent ``c`` (``kv_lora_rank`` values) and the rotated
rope key every head shares (``qk_rope_head_dim``): one ``[.., 1, S, kv_lora_rank + qk_rope_head_dim]`` "key" per
(layer, tp rank) and an empty value. Keys and values of the heads are re-expanded from it (``kv_b``) at every
step: the naive (non-absorbed) form of MLA, which gives transformers' numbers (the oracle:
transformers 5.25 ``DeepseekV3Attention`` and ``DeepseekV3TopkRouter``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from trtpipe.errors import CheckpointError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def yarn_mscale(scaling: Optional[dict]) -> float:
    """The factor DeepSeek's attention scale is multiplied by under YaRN: ``mscale(factor, mscale_all_dim) ** 2``,
    ``mscale = 0.1 * m * ln(factor) + 1`` (transformers ``yarn_apply_mscale``; 1 without YaRN or mscale_all_dim)."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    m_all, factor = scaling.get("mscale_all_dim") or 0, scaling.get("factor") or 1.0
    if kind in (None, "default") or not m_all or factor <= 1:
        return 1.0
    return (0.1 * m_all * math.log(factor) + 1.0) ** 2


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3)..., written out de-interleaved (evens' rotation, then odds'), as
    transformers' ``apply_rotary_pos_emb_interleave``: q and k get the same layout, so their products are the same.
    cos/sin [.., T, rot] hold each frequency twice (the rotate-half tables); the first half is used."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def group_limited_route(
    x: torch.Tensor,
    router: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> torch.Tensor:
    """DeepSeek-V3 ``noaux_tc`` routing weights [N, E] (0 for unselected experts): sigmoid scores in float32 (or
    wider); the bias shifts the choice only; the best ``topk_groups`` of ``groups`` groups (a group scores the sum of
    its two best biased scores) hold the top-k; the chosen experts' unbiased scores, divided by their sum (plus
    1e-20, as transformers) when ``renormalize``, times ``scaling``."""
    dt = torch.promote_types(x.dtype, torch.float32)
    scores = (x.to(dt) @ router.to(dt).t()).sigmoid()  # [N, E]
    choice = scores + bias.to(dt)
    n, e = scores.shape
    group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1).values.sum(-1)  # [N, G]
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, 1.0)
    keep = keep.bool()[:, :, None].expand(n, groups, e // groups).reshape(n, e)
    idx = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return torch.zeros_like(scores).scatter_(1, idx, w * scaling)


class MLAAttentionShard(nn.Module):
    """One tp rank's MLA: its heads of q_b (or q) and kv_b, and its slice of dense; q_a and kv_a are replicated."""

    def __init__(self, tensors: dict, prefix: str, args, rank: int, make_linear):
        super().__init__()
        a = args.mla
        kv_algo = (args.quantization or {}).get("kv_cache_quant_algo")
        if kv_algo:
            raise CheckpointError(
                f"checkpoint: kv_cache_quant_algo {kv_algo} is not supported for multi-head latent attention "
                "(the reference runtime caches the latent unquantized)"
            )
        self.nh = args.heads_per_rank
        self.nope, self.rope_dim, self.dv, self.kvl = (
            a.qk_nope_head_dim,
            a.qk_rope_head_dim,
            a.v_head_dim,
            a.kv_lora_rank,
        )
        self.nkv, self.d = 1, a.kv_lora_rank + a.qk_rope_head_dim  # the cache: one latent "head" per token
        self.dv_cache = 0  # nothing is cached as the value
        self.eps = args.norm_epsilon
        self.interleave = args.rope_interleave
        self.scale = (a.qk_nope_head_dim + a.qk_rope_head_dim) ** -0.5 * yarn_mscale(args.rotary_scaling)
        if a.q_lora_rank:
            self.q_a = make_linear(tensors, prefix, "attention.q_a", "column", args, rank)
            self.q_a_ln = _need(tensors, prefix, "attention.q_a_layernorm.weight").float()
            self.q_b = make_linear(tensors, prefix, "attention.q_b", "column", args, rank)
        else:
            self.q = make_linear(tensors, prefix, "attention.q", "column", args, rank)
        self.kv_a = make_linear(tensors, prefix, "attention.kv_a", "column", args, rank)
        self.kv_a_ln = _need(tensors, prefix, "attention.kv_a_layernorm.weight").float()
        self.kv_b = make_linear(tensors, prefix, "attention.kv_b", "column", args, rank)
        self.dense = make_linear(tensors, prefix, "attention.dense", "row", args, rank)
        self.window, self.sinks = None, None

    def _rope(self, x, cos, sin):
        if self.interleave:
            return apply_rope_interleaved(x, cos, sin)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [.., 1, S, kvl + rope] -> keys [.., nh, S, nope + rope] and values [.., nh, S, v]."""
        c, k_rope = latent[..., : self.kvl], latent[..., self.kvl :]
        kv = self.kv_b(c)  # [.., 1, S, nh * (nope + v)]
        kv = kv.unflatten(-1, (self.nh, self.nope + self.dv)).squeeze(-4).transpose(-3, -2)  # [.., nh, S, nope + v]
        k_nope, v = kv.split([self.nope, self.dv], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(*k_nope.shape[:-1], self.rope_dim)], dim=-1)
        return k, v

    def forward(self, x, cos, sin, start_pos, cache, key):
        """x: [B, T, H] at positions start_pos.. (one int, or a LongTensor [B] of per-row starts)."""
        B, T, _ = x.shape
        q = self.q(x) if hasattr(self, "q") else self.q_b(rms_norm(self.q_a(x), self.q_a_ln, self.eps))
        q = q.view(B, T, self.nh, self.nope + self.rope_dim).transpose(1, 2)  # [B, nh, T, qk]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a(x).split([self.kvl, self.rope_dim], dim=-1)
        c = rms_norm(c, self.kv_a_ln, self.eps)
        k_rope = self._rope(k_rope.view(B, 1, T, self.rope_dim), cos, sin)
        q = torch.cat([q_nope, self._rope(q_rope, cos, sin)], dim=-1)
        latent = torch.cat([c.view(B, 1, T, self.kvl), k_rope], dim=-1)  # [B, 1, T, kvl + rope]: what is cached
        if hasattr(cache, "attend_latent"):  # a paged KV pool (the serving executor's packed steps)
            return self.dense(cache.attend_latent(key, q, latent, self.expand, self.scale))
        q_pos = _positions(start_pos, T, x.device)
        empty = latent[..., :0]
        if hasattr(cache, "keep"):  # a BatchKVCache (rows at their own positions; index == position)
            latent, _ = cache.update(key, latent, empty, q_pos)
            k_pos = torch.arange(latent.shape[2], device=x.device)[None]
        else:
            if cache is not None:
                latent, _ = cache.update(key, latent, empty)
            S = latent.shape[2]
            k_pos = q_pos[:, -1:] + 1 - S + torch.arange(S, device=x.device)
        k, v = self.expand(latent)  # [B, nh, S, qk], [B, nh, S, v]
        allowed = k_pos[:, None, :] <= q_pos[:, :, None]  # [B|1, T, S]
        scores = (q @ k.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [B, nh, T, v]
        return self.dense(out.transpose(1, 2).reshape(B, T, self.nh * self.dv))  # partial [B, T, H]


def _positions(start_pos, T: int, device) -> torch.Tensor:
    """trtpipe.runtime.model.positions (not imported: model imports this module): [1, T] or per row [B, T]."""
    if isinstance(start_pos, torch.Tensor) and start_pos.dim() == 1:
        return start_pos.to(device)[:, None] + torch.arange(T, device=device)
    return torch.arange(int(start_pos), int(start_pos) + T, device=device)[None]


def _need(tensors: dict, prefix: str, name: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint: tensor '{prefix}{name}' is missing")
    return tensors[name]
