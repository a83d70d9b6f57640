"""Tensor-parallel, pipeline-parallel and expert-parallel splits as pure functions of (tensor, rank, world).

Nothing here reads the environment or knows about files: every function takes the rank and sizes as
arguments and returns a view where it can (slices), so the streaming writer copies each byte once.

A linear's tensors are split by *axis roles*: the weight ``[out, in]`` (``[E, out, in]`` for experts) has
an out axis and an in axis; a bias or per-channel scale only an out axis; a pre-quant scale only an in
axis; a per-tensor scale neither. Column-parallel splits the out axis, row-parallel the in axis. A packed
or grouped axis (int4 pairs, group scales) is split in proportion to its length, so the same plan splits
weights and scales (tensor parallelism as pure split functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from trtpipe.errors import CheckpointError


def pp_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global layer indices on a PP rank: torch.tensor_split rule (the first num_layers % pp ranks get one more)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def split_even(t: torch.Tensor, dim: int, rank: int, world: int, what: str = "tensor") -> torch.Tensor:
    """The rank-th of ``world`` equal contiguous chunks along ``dim`` (a view)."""
    size = t.shape[dim]
    if size % world:
        raise CheckpointError(f"{what}: dim {dim} of size {size} is not divisible by {world}")
    chunk = size // world
    return t.narrow(dim, rank * chunk, chunk)


def split_sections(
    t: torch.Tensor, dim: int, sections: Sequence[int], rank: int, world: int, what: str = "tensor"
) -> torch.Tensor:
    """Split each of the consecutive ``sections`` along ``dim`` evenly and concatenate the rank's pieces.

    This is the fused-qkv rule ([q; k; v] -> [q_r; k_r; v_r]) and the MoE fc rule ([w3; w1]).
    """
    if sum(sections) != t.shape[dim]:
        raise CheckpointError(f"{what}: dim {dim} is {t.shape[dim]}, expected {sum(sections)} ({list(sections)})")
    if len(sections) == 1:
        return split_even(t, dim, rank, world, what)
    parts = torch.split(t, list(sections), dim=dim)
    return torch.cat([split_even(p, dim, rank, world, what) for p in parts], dim=dim)


def replicate_kv_heads(
    t: torch.Tensor, dim: int, q_size: int, num_kv_heads: int, head_size: int, tp: int, what: str = "qkv"
) -> torch.Tensor:
    """For num_kv_heads < tp: repeat each KV head tp/num_kv_heads times in head order ([h0,h0,..,h1,h1,..]).

    ``t`` is a fused [q; k; v] along ``dim`` (lengths may be scaled, e.g. packed int4); returns the fused
    tensor with tp KV heads so an even split gives each rank one.
    """
    if num_kv_heads >= tp:
        return t
    if tp % num_kv_heads:
        raise CheckpointError(f"{what}: tp={tp} is not a multiple of num_key_value_heads={num_kv_heads}")
    reps = tp // num_kv_heads
    kv = num_kv_heads * head_size
    q, k, v = torch.split(t, [q_size, kv, kv], dim=dim)

    def rep(x):
        shape = list(x.shape)
        heads = x.unflatten(dim, (num_kv_heads, head_size))  # [..., nkv, d, ...]
        return heads.repeat_interleave(reps, dim=dim).reshape(shape[:dim] + [kv * reps] + shape[dim + 1 :])

    return torch.cat([q, rep(k), rep(v)], dim=dim)


def pad_dim(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad ``dim`` up to a multiple (lm_head vocab padding); a no-op view when already aligned."""
    size = t.shape[dim]
    padded = -(-size // multiple) * multiple
    if padded == size:
        return t
    shape = list(t.shape)
    shape[dim] = padded - size
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=dim)


@dataclass(frozen=True)
class Layout:
    """The numbers the splits need (from the HF config and the parallel mapping)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    tp: int = 1
    num_experts: int = 0
    moe_tp: int = 1
    moe_ep: int = 1
    use_parallel_embedding: bool = False
    embedding_sharding_dim: int = 0
    # attention data parallel: every rank holds every tensor but the routed experts' whole (NVIDIA/TensorRT-LLM@000561df
    # tensorrt_llm/_torch/models/modeling_deepseekv3.py: attention without its all-reduce, the dense MLP and the
    # shared experts at tp 1 "instead of TP"); the experts are split by moe_ep x moe_tp as without it
    attention_dp: bool = False

    def check(self) -> None:
        if self.attention_dp:
            if not self.num_experts or self.tp < 2:
                raise CheckpointError(
                    f"attention data parallel needs a mixture-of-experts model at tp > 1 (its MoE layers are what "
                    f"the ranks share); got {self.num_experts} experts at tp={self.tp}"
                )
            if self.use_parallel_embedding:
                raise CheckpointError("attention data parallel keeps the whole embedding on every rank")
        else:  # attention heads are split over the tp ranks
            if self.num_heads % self.tp:
                raise CheckpointError(f"num_attention_heads={self.num_heads} is not divisible by tp={self.tp}")
            if self.num_kv_heads >= self.tp and self.num_kv_heads % self.tp:
                raise CheckpointError(f"num_key_value_heads={self.num_kv_heads} is not divisible by tp={self.tp}")
            if self.num_kv_heads < self.tp and self.tp % self.num_kv_heads:
                raise CheckpointError(f"tp={self.tp} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.num_experts:
            if self.moe_tp * self.moe_ep != self.tp:
                raise CheckpointError(f"moe_tp={self.moe_tp} x moe_ep={self.moe_ep} must equal tp={self.tp}")
            if self.num_experts % self.moe_ep:
                raise CheckpointError(f"num_local_experts={self.num_experts} is not divisible by moe_ep={self.moe_ep}")


# Axis roles of a linear's tensors by suffix: (out axis, in axis) counted from the end; None = absent.
# Suffixes not listed follow their shape: numel 1 -> per-tensor (replicated).
AXES: dict[str, tuple[Optional[int], Optional[int]]] = {
    "weight": (-2, -1),
    "bias": (-1, None),
    "per_channel_scale": (-1, None),
    "weights_scaling_factor": (-2, -1),  # group scales [out, in/g]; [out] and [1] handled by shape below
    "prequant_scaling_factor": (None, -1),
    "smoother": (None, -1),
    "zero": (-1, -2),  # groupwise zeros are [in/g, out], the layer's own layout (trtllm-build does not transpose them)
}


def tensor_axes(suffix: str, t: torch.Tensor, experts: int = 0) -> tuple[Optional[int], Optional[int]]:
    """(out axis, in axis) of one of a linear's tensors (negative indices)."""
    has_experts = bool(experts) and t.dim() >= 2 and t.shape[0] == experts
    dims = t.dim() - (1 if has_experts else 0)
    core = t.numel() // (experts if has_experts else 1)
    if core == 1 or dims == 0:
        return None, None  # per-tensor (or per-expert scalar) scales are replicated
    out_ax, in_ax = AXES.get(suffix, (-1, None) if dims == 1 else (-2, -1))
    if dims == 1 and out_ax is not None and in_ax is not None:
        in_ax = None  # a per-channel vector of a 2D-role suffix (e.g. weights_scaling_factor [out])
    if dims == 1 and out_ax is not None:
        out_ax = -1
    return out_ax, in_ax


def _scaled(sections: Sequence[int], length: int, what: str) -> list[int]:
    total = sum(sections)
    if any((s * length) % total for s in sections):
        raise CheckpointError(f"{what}: length {length} does not scale the sections {list(sections)}")
    return [s * length // total for s in sections]


def split_linear_tensor(
    t: torch.Tensor,
    suffix: str,
    style: str,
    rank: int,
    layout: Layout,
    sections: Sequence[int] = (),
    experts: int = 0,
    what: str = "tensor",
) -> torch.Tensor:
    """Split one tensor of a linear for tp ``rank``.

    Args:
        t: the unsharded tensor (weight, bias or scale).
        suffix: its name after the module (``weight``, ``bias``, ``weights_scaling_factor`` ...).
        style: ``column``, ``row``, ``qkv`` (column with GQA sections and KV replication) or ``replicate``.
        sections: logical out-axis sections for fused column layers ([q, k, v] or [w3, w1]).
        experts: number of experts when ``t`` has a leading expert axis (moe: tp is then moe_tp).
    """
    if style == "replicate":
        return t
    world = layout.moe_tp if experts else layout.tp
    tp_rank = rank // layout.moe_ep if experts else rank
    out_ax, in_ax = tensor_axes(suffix, t, experts)
    if style == "row":
        return t if in_ax is None else split_even(t, t.dim() + in_ax, tp_rank, world, what)
    if out_ax is None:
        return t
    dim = t.dim() + out_ax
    if style == "qkv":
        q = layout.num_heads * layout.head_size
        kv = layout.num_kv_heads * layout.head_size
        q, k, _ = _scaled([q, kv, kv], t.shape[dim], what)
        head = k // layout.num_kv_heads
        t = replicate_kv_heads(t, dim, q, layout.num_kv_heads, head, world, what)
        kv_r = max(layout.num_kv_heads, world) * head
        return split_sections(t, dim, [q, kv_r, kv_r], tp_rank, world, what)
    if sections:
        return split_sections(t, dim, _scaled(sections, t.shape[dim], what), tp_rank, world, what)
    return split_even(t, dim, tp_rank, world, what)


def split_experts(t: torch.Tensor, rank: int, layout: Layout, what: str = "tensor") -> torch.Tensor:
    """The contiguous block of experts of this rank's moe_ep group: [E, ...] -> [E/moe_ep, ...]."""
    if t.dim() == 0 or t.shape[0] != layout.num_experts:
        return t  # a scale shared by all experts
    return split_even(t, 0, rank % layout.moe_ep, layout.moe_ep, what)


def split_vocab(t: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """lm_head / parallel embedding: zero-pad ``dim`` to a multiple of world, then take the rank's chunk."""
    return split_even(pad_dim(t, dim, world), dim, rank, world, "vocab")
