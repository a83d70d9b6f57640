"""Attention data parallel in the one-process-per-rank twin: which rank runs which request, and one step over them.

TensorRT-LLM's attention DP (``enable_attention_dp``) gives every rank its own requests: each runs attention with
whole attention weights over its own KV cache, and only the MoE layers bring the ranks together (expert parallel;
NVIDIA/TensorRT-LLM@000561df ``tensorrt_llm/_torch/models/modeling_deepseekv3.py``). In the twin, rank 0's executor
still schedules one batch; :class:`RankAssigner` (rank 0) puts each of its requests on a rank, the assignment travels
with the broadcast step, and :func:`step_logits` (every rank) runs that rank's entries only -- their tokens, their
paged KV -- with the MoE exchange inside the layers (:meth:`trtpipe.runtime.distributed.Comm.moe_exchange`); the
logits rows come back to rank 0, which samples them in the batch's order.

The assignment (the twin's policy, not TensorRT-LLM's balancer): a request keeps its rank while it runs; a new
request whose first step starts past position 0 (a reused prefix) goes to the rank that wrote the last reused block,
since only that rank holds it; any other new request goes to the rank with the fewest of this step's requests
(ties: the lowest rank). Every rank allocates the executor's block pool, but a block holds data only on the rank
that wrote it.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from trtpipe.serving.api import StepBatch
from trtpipe.serving.logprobs import rows_of


class RankAssigner:
    """Rank 0's map of requests and KV blocks to attention-DP ranks."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.request_rank: dict = {}  # the requests of the last step -> rank
        self.block_rank: dict[int, int] = {}  # KV block -> the rank whose pool holds its data

    def assign(self, batch: StepBatch, tokens_per_block: int) -> list[int]:
        """The rank of each entry of ``batch``, in entry order; records the blocks each entry writes."""
        load = [0] * self.ranks
        for e in batch.entries:
            if e.request_id in self.request_rank:
                load[self.request_rank[e.request_id]] += 1
        out = []
        for e in batch.entries:
            rank = self.request_rank.get(e.request_id)
            if rank is None and e.start_pos > 0:  # resumes on cached blocks: where they are
                rank = self.block_rank.get(e.block_table[(e.start_pos - 1) // tokens_per_block])
            if rank is None:
                rank = min(range(self.ranks), key=lambda r: (load[r], r))
            if e.request_id not in self.request_rank:
                load[rank] += 1
            self.request_rank[e.request_id] = rank
            first, last = e.start_pos // tokens_per_block, (e.start_pos + len(e.tokens) - 1) // tokens_per_block
            for b in e.block_table[first : last + 1]:
                self.block_rank[b] = rank
            out.append(rank)
        self.request_rank = {e.request_id: r for e, r in zip(batch.entries, out)}  # finished ones are forgotten
        return out

    def copied(self, src: int, dst: int) -> None:
        """A block copy (a reused partial block): the copy is where its source is."""
        if src in self.block_rank:
            self.block_rank[dst] = self.block_rank[src]


def step_logits(engine, batch: StepBatch, ranks: list[int]) -> Optional[torch.Tensor]:
    """Every rank: run this rank's entries of ``batch`` (or only the MoE exchange, with none); rank 0 gets the
    logits rows of the whole batch in :func:`~trtpipe.serving.logprobs.rows_of` order, the others None."""
    model = engine.model
    me = model.layout.tp_rank
    mine = StepBatch(batch.iteration, [e for e, r in zip(batch.entries, ranks) if r == me])
    if mine.entries:
        ids, paged, cos_sin, ends = engine.packed(mine)
        own = model.forward(ids, paged, 0, rows=torch.tensor(ends, dtype=torch.long), cos_sin=cos_sin)
    else:
        model.idle()
        own = torch.zeros(0, model.args.vocab_size)
    parts = model.comm.tp_comm.gather(own.float().numpy(), root=0)
    if me != 0:
        return None
    taken, rows = [0] * len(parts), []
    for e, r in zip(batch.entries, ranks):  # the rows of one entry do not depend on the others
        n = len(rows_of(StepBatch(batch.iteration, [e]))[0])
        rows.append(parts[r][taken[r] : taken[r] + n])
        taken[r] += n
    return torch.from_numpy(np.concatenate(rows)) if rows else torch.zeros(0, model.args.vocab_size)
