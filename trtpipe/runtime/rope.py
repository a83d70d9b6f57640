"""Rotary position embeddings for the reference runtime, one function per ``rotary_scaling`` type.

The formulas follow Hugging Face transformers (the oracle) so logits match it exactly; the table
``INV_FREQ`` is keyed by the TensorRT-LLM/HF ``rope_type`` name. Each entry returns the inverse
frequencies and the factor that scales cos/sin (only yarn uses it).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from trtpipe.errors import CheckpointError


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _default(base, dim, scaling, max_pos, seq_len):
    return _base_inv_freq(base, dim), 1.0


def _linear(base, dim, scaling, max_pos, seq_len):
    return _base_inv_freq(base, dim) / scaling["factor"], 1.0


def _dynamic(base, dim, scaling, max_pos, seq_len):
    """NTK-aware scaling: the base grows once the sequence is longer than max_position_embeddings."""
    factor = scaling["factor"]
    seq_len = max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(base, dim, scaling, max_pos, seq_len):
    inv_freq = _base_inv_freq(base, dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn(base, dim, scaling, max_pos, seq_len):
    factor = scaling.get("factor") or max_pos / scaling["original_max_position_embeddings"]
    orig = scaling.get("original_max_position_embeddings") or max_pos

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


INV_FREQ: dict[str, Callable] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


class Rope:
    """cos/sin tables for positions ``start .. start+T``; rotates the first ``dim`` channels of each head."""

    def __init__(self, dim: int, base: float, scaling: Optional[dict], max_position_embeddings: Optional[int]):
        self.dim, self.base, self.scaling = dim, base, scaling or {}
        self.kind = rope_type(scaling)
        if self.kind not in INV_FREQ:
            raise CheckpointError(
                f"config.json: rotary_scaling type '{self.kind}' is not supported (known: {sorted(INV_FREQ)})"
            )
        self.max_pos = max_position_embeddings or 2048

    def cos_sin(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attn_factor = INV_FREQ[self.kind](self.base, self.dim, self.scaling, self.max_pos, start + length)
        pos = torch.arange(start, start + length, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
        return emb.cos() * attn_factor, emb.sin() * attn_factor

    def cos_sin_rows(self, starts: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row tables for rows at different positions (batched decoding): row b covers
        ``starts[b] .. starts[b]+length``. Returns cos, sin [B, 1, T, dim] (broadcast over heads).

        Why per row: "dynamic" NTK scaling picks its base from the sequence length, so each row gets the
        inverse frequencies its own sequence would get (as :meth:`cos_sin` gives a single sequence).
        """
        starts = starts.cpu()
        if self.kind == "dynamic":
            rows = [self.cos_sin(int(s), length) for s in starts]
            return torch.stack([c for c, _ in rows])[:, None], torch.stack([s for _, s in rows])[:, None]
        # only "dynamic" reads seq_len: the others share one table
        inv_freq, attn_factor = INV_FREQ[self.kind](self.base, self.dim, self.scaling, self.max_pos, 0)
        pos = (starts[:, None] + torch.arange(length)).float()  # [B, T]
        freqs = pos[:, :, None] * inv_freq  # [B, T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, dim]
        return emb.cos() * attn_factor, emb.sin() * attn_factor

    def cos_sin_for(self, start_pos, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` for one int start ([T, dim]), :meth:`cos_sin_rows` for a LongTensor [B] of starts."""
        if isinstance(start_pos, torch.Tensor) and start_pos.dim() == 1:
            return self.cos_sin_rows(start_pos, length)
        return self.cos_sin(int(start_pos), length)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin [T, rot] or per row [B, 1, T, rot]; rotate_half (GPT-NeoX) layout on the
    first ``rot`` channels."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
