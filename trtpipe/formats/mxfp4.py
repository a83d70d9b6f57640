"""MXFP4 (OCP Microscaling FP4) as stored in Hugging Face checkpoints: pure decode and encode of (blocks, scales).

The layout, as transformers 5.24 ``integrations/mxfp4.py`` (``_convert_moe_packed_tensors``, ``FP4_VALUES``) reads
it and gpt-oss ships it (``mlp.experts.{gate_up,down}_proj_{blocks,scales}``):

* ``blocks``: uint8 ``[..., G, 16]``; each byte holds two FP4 E2M1 codes, the **low nibble first** (element 2j), the
  high nibble second (element 2j+1), so 16 bytes are one group of 32 elements along the last (input) axis.
* ``scales``: uint8 ``[..., G]``, E8M0: the group's power of two ``2 ** (scale - 127)``.
* value = ``E2M1[code] * 2 ** (scale - 127)``; E2M1 code bit 3 is the sign, bits 0-2 index
  ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``.

The result is ``[..., G * 32]``: the leading axes are kept as stored (gpt-oss stores ``[experts, out, in/32, 16]``,
so the decode is ``[experts, out, in]``; transformers then transposes it into its ``[experts, in, out]`` parameter).
Nothing here knows a model: callers name the tensors and reorder axes.
"""

from __future__ import annotations

import torch

GROUP = 32  # elements per scale
E8M0_BIAS = 127
# E2M1 magnitudes by the low three bits of a code; bit 3 is the sign (code 8 is -0.0)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 code values, ``[+0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, ..., -6]``."""
    mags = torch.tensor(E2M1, dtype=dtype)
    return torch.cat([mags, -mags])


def check_shapes(blocks: torch.Tensor, scales: torch.Tensor, what: str = "mxfp4") -> None:
    """blocks ``[..., G, 16]`` uint8 and scales ``[..., G]`` uint8, the same leading axes; a one-line error otherwise."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: blocks and scales must be uint8 (got {blocks.dtype}, {scales.dtype})")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{what}: blocks {list(blocks.shape)} and scales {list(scales.shape)} do not form "
            f"[..., G, {GROUP // 2}] and [..., G]"
        )


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., G, 16]`` uint8 blocks and ``[..., G]`` E8M0 scales -> ``[..., G * 32]`` values in ``dtype``.

    Exact in float32 and float64 (every product is a power of two times a 3-bit value); bfloat16 loses only values
    beyond its exponent range, as transformers' own bf16 dequantization does."""
    check_shapes(blocks, scales)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = e2m1_table(dtype)[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1).to(dtype)).flatten(-2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` (K a multiple of 32) -> (blocks ``[..., K/32, 16]``, scales ``[..., K/32]``), the OCP MX rule:
    each group's scale is ``2 ** (floor(log2(amax)) - 2)`` (E2M1's largest exponent is 2), values rounded to the
    nearest code (a tie to the smaller magnitude) and clipped at +-6. Used to write synthetic checkpoints as gpt-oss ships
    them; :func:`dequantize` is the oracle either way."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"mxfp4: last axis {w.shape[-1]} is not a multiple of {GROUP}")
    groups = w.double().unflatten(-1, (w.shape[-1] // GROUP, GROUP))  # [..., G, 32]
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2, torch.zeros_like(amax))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.pow(2.0, exp).unsqueeze(-1)
    mags = torch.tensor(E2M1, dtype=torch.float64)
    dist = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - mags).abs()  # [..., G, 32, 8]
    best = dist.argmin(-1)  # nearest magnitude; a tie takes the smaller one
    codes = (best + torch.where(scaled < 0, 8, 0)).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp + E8M0_BIAS).to(torch.uint8)
