"""Stacked MoE expert weights, streamed to each rank without building the stack.

TensorRT-LLM's MoE reads one tensor per layer for all experts: ``mlp.fc`` [E, 2I, H] (each expert's rows of the
first source, then of the second: up then gate) and ``mlp.proj`` [E, H, I]. Hugging Face stores one tensor per
expert and projection. Stacking them in memory holds the layer's experts twice (the file pages and the copy: 9.7 GB
for one Qwen3-235B-A22B layer), so the streaming converter describes the fused tensor as its parts instead and
writes each rank's shard part by part:

    rank's mlp.fc   = for e in this rank's experts (moe_ep block): for each source: source_e[moe_tp rows]
    rank's mlp.proj = for e in this rank's experts: down_e[:, moe_tp columns]

which is, byte for byte, ``split_experts`` then ``split_linear_tensor`` of the stacked tensor (the planning pass
runs those on meta tensors and checks every size first; tests/checkpoint/test_expert_stream.py compares the bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtpipe.checkpoint.shard import Layout

# Rule split styles whose experts stream (the fused tensor's out axis is dim -2, its in axis dim -1)
STREAMED_SPLITS = {"moe_fc": "column", "moe_proj": "row"}


@dataclass(frozen=True)
class ExpertParts:
    """The fused tensor ``cat([stack(sources[0]), stack(sources[1]), ...], dim=-2)``, not built.

    Attributes:
        sources: per source (e.g. up, gate), one 2-D [out, in] tensor per expert (views of the file).
        names: the HF names, same nesting (for error messages).
    """

    sources: tuple[tuple[torch.Tensor, ...], ...]
    names: tuple[tuple[str, ...], ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        first = self.sources[0][0]
        return len(self.sources[0]), sum(s[0].shape[0] for s in self.sources), first.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.sources[0][0].dtype

    def rank_parts(self, layout: Layout, tp_rank: int, split: str) -> list[tuple[torch.Tensor, str]]:
        """(part, HF name) in the order they fill tp rank ``tp_rank``'s shard (moe_ep block of experts, then
        moe_tp slice of each; the same rank arithmetic as :func:`trtpipe.checkpoint.shard.split_linear_tensor`)."""
        style = STREAMED_SPLITS[split]
        per = layout.num_experts // layout.moe_ep
        ep_rank, mtp_rank = tp_rank % layout.moe_ep, tp_rank // layout.moe_ep
        out = []
        for e in range(ep_rank * per, (ep_rank + 1) * per):
            for src, names in zip(self.sources, self.names):
                p = src[e]
                if style == "column":
                    n = p.shape[0] // layout.moe_tp
                    out.append((p[mtp_rank * n : (mtp_rank + 1) * n], names[e]))
                else:
                    n = p.shape[1] // layout.moe_tp
                    out.append((p[:, mtp_rank * n : (mtp_rank + 1) * n], names[e]))
        return out


def streams(rule, parts: list[list[torch.Tensor]]) -> bool:
    """Whether a rule's fused experts can be written part by part: 2-D expert weights of a moe split, no offset."""
    return (
        rule.split in STREAMED_SPLITS
        and "experts" in rule.combine
        and not rule.offset
        and rule.trt.endswith(".weight")
        and all(p.dim() == 2 for group in parts for p in group)
    )
