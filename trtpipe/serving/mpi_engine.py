"""The step engine split over MPI ranks (leader mode): rank 0's executor calls ``step(batch)``; the batch is
broadcast; every rank runs its shard of the same step on its own paged KV pool; tokens come back on rank 0.

Workers (ranks > 0) run :func:`worker_loop`: they hold no scheduling state, only their KV pool, and do whatever
rank 0 broadcasts (``allocate``, ``step``, ``copy``, ``stop``), so a dead worker means a dead job, not a confused
one. Sampling happens on rank 0 (it holds each request's seeded generator).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from trtpipe.runtime.distributed import RankModel
from trtpipe.runtime.generate import sample
from trtpipe.runtime.model import BatchKVCache
from trtpipe.serving.api import SamplingParams, StepBatch, StepEntry, StepResult


class RankKV:
    """One rank's paged KV pool: per local layer, keys and values [num_blocks, kv_heads_r, tokens_per_block, d]."""

    def __init__(self, model: RankModel):
        self.model = model
        self.pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens_per_block = 0

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        a = self.model.args
        shape = (num_blocks, a.kv_heads_per_rank, tokens_per_block, a.head_size)
        # zeros, not empty: attention weights of masked slots are 0, and 0 * NaN garbage would still be NaN
        self.pools = {layer.layer_idx: (torch.zeros(shape), torch.zeros(shape)) for layer in self.model.layers}
        self.tokens_per_block = tokens_per_block

    def copy(self, src: int, dst: int, num_tokens: int) -> None:
        for k, v in self.pools.values():
            k[dst, :, :num_tokens] = k[src, :, :num_tokens]
            v[dst, :, :num_tokens] = v[src, :, :num_tokens]


class PagedCache(BatchKVCache):
    """The runtime's batched-decoding cache interface (index == position per row) over block tables.

    A step is run as a right-padded batch [B, T]: row b holds entry b's tokens at positions ``start_b..``;
    only positions below ``ends[b]`` are written, and reads gather positions 0..S-1 through the row's table
    (slots past a row's end are masked by causality).
    """

    def __init__(self, kv: RankKV, tables: torch.Tensor, ends: torch.Tensor):
        super().__init__({})
        self.kv, self.tables, self.ends = kv, tables, ends  # [B, max_blocks], [B]

    def update(self, key, k, v, pos):
        K, V = self.kv.pools[key[0]]
        tpb = self.kv.tokens_per_block
        b, t = (pos < self.ends[:, None]).nonzero(as_tuple=True)  # the real (unpadded) tokens
        p = pos[b, t]
        blk, off = self.tables[b, p // tpb], p % tpb
        K[blk, :, off] = k[b, :, t]  # [M, nkv, d]
        V[blk, :, off] = v[b, :, t]
        S = int(pos.max()) + 1
        sp = torch.arange(S)
        blocks = self.tables[:, (sp // tpb).clamp(max=self.tables.shape[1] - 1)]  # [B, S]
        offs = (sp % tpb).expand_as(blocks)
        return K[blocks, :, offs].transpose(1, 2), V[blocks, :, offs].transpose(1, 2)  # [B, nkv, S, d]


def run_step(model: RankModel, kv: RankKV, wire: list[tuple]) -> Optional[torch.Tensor]:
    """Every rank's part of one step; ``wire``: (tokens, start_pos, block_table, sample) per entry.

    Returns, on rank 0, the logits [n, V] of the entries that sample (in entry order); None elsewhere.
    """
    B, T = len(wire), max(len(w[0]) for w in wire)
    ids = torch.zeros(B, T, dtype=torch.long)
    width = max(len(w[2]) for w in wire) or 1
    tables = torch.zeros(B, width, dtype=torch.long)
    starts = torch.tensor([w[1] for w in wire], dtype=torch.long)
    ends = torch.tensor([w[1] + len(w[0]) for w in wire], dtype=torch.long)
    for b, (tokens, _, table, _) in enumerate(wire):
        ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.long)
    rows = torch.tensor([b * T + len(w[0]) - 1 for b, w in enumerate(wire) if w[3]], dtype=torch.long)
    return model.forward(ids, PagedCache(kv, tables, ends), starts, rows=rows)


def execute(model: RankModel, kv: RankKV, command: tuple):
    """Run one broadcast command on this rank (the same code on rank 0 and on the workers)."""
    kind = command[0]
    if kind == "step":
        return run_step(model, kv, command[1])
    if kind == "allocate":
        kv.allocate(command[1], command[2])
    elif kind == "copy":
        kv.copy(*command[1:])
    return None


def worker_loop(model: RankModel) -> None:
    """A worker rank: follow rank 0's broadcasts until ``stop``."""
    kv = RankKV(model)
    with torch.no_grad():
        while True:
            command = model.comm.bcast(None)
            if command[0] == "stop":
                return
            execute(model, kv, command)


class MpiStepEngine:
    """The :class:`~trtpipe.serving.api.StepEngine` of rank 0: broadcast, run its own shard, sample."""

    def __init__(self, model: RankModel):
        if model.layout.rank != 0:
            raise ValueError("MpiStepEngine runs on rank 0; other ranks run worker_loop")
        self.model = model
        self.kv = RankKV(model)
        self.stopped = False

    def _command(self, command: tuple):
        self.model.comm.bcast(command)
        return execute(self.model, self.kv, command)

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        self._command(("allocate", int(num_blocks), int(tokens_per_block)))

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        self._command(("copy", int(src), int(dst), int(num_tokens)))

    @torch.no_grad()
    def step(self, batch: StepBatch) -> StepResult:
        t0 = time.perf_counter()
        tokens: dict[int, int] = {}
        if batch.entries:
            wire = [(list(map(int, e.tokens)), int(e.start_pos), list(map(int, e.block_table)), bool(e.sample))
                    for e in batch.entries]
            logits = self._command(("step", wire))
            sampled = [e for e in batch.entries if e.sample]
            for e, row in zip(sampled, logits):
                s = e.sampling
                tokens[e.request_id] = sample(row, s.temperature, s.top_k, s.top_p, e.generator)
        return StepResult(tokens, time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Release the workers (they return from :func:`worker_loop`)."""
        if not self.stopped:
            self.stopped = True
            self.model.comm.bcast(("stop",))


def generate_steps(engine, prompts: list[list[int]], max_new_tokens: int, end_ids=None, temperature: float = 0.0,
                   top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, stop_words=None,
                   on_step: Optional[Callable[[list], None]] = None, tokens_per_block: int = 64) -> list[list[int]]:
    """:func:`trtpipe.runtime.generate` semantics over a step engine: the prompts prefill in one step, then
    every step decodes all unfinished sequences. Each sequence gets contiguous blocks of a pool allocated for
    this call. (A static batch: the in-flight executor replaces this for serving.)
    """
    from trtpipe.runtime.generate import _hits_stop, _per_sequence

    n = len(prompts)
    ends, stops = _per_sequence(end_ids, n, 0), _per_sequence(stop_words, n, 1)
    params = SamplingParams(temperature, top_k, top_p, seed)
    gens = [None if seed is None else torch.Generator().manual_seed(int(seed) + i) for i in range(n)]
    need = [-(-(len(p) + max(0, max_new_tokens)) // tokens_per_block) for p in prompts]
    first = [sum(need[:i]) for i in range(n)]
    engine.allocate(max(1, sum(need)), tokens_per_block)
    tables = [list(range(first[i], first[i] + need[i])) for i in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    done = [max_new_tokens <= 0 or not p for p in prompts]
    for it in range(max(0, max_new_tokens)):
        rows = [i for i in range(n) if not done[i]]
        if not rows:
            break
        entries = [StepEntry(i, list(prompts[i]) if it == 0 else [outputs[i][-1]],
                             0 if it == 0 else len(prompts[i]) + len(outputs[i]) - 1, tables[i], it == 0, True,
                             params, gens[i]) for i in rows]
        got = engine.step(StepBatch(it, entries)).tokens
        new: list = [None] * n
        for i in rows:
            tok = got[i]
            if ends[i] is not None and tok == ends[i]:
                done[i] = True
                continue
            outputs[i].append(tok)
            new[i] = [tok]
            if len(outputs[i]) >= max_new_tokens or _hits_stop(outputs[i], stops[i]):
                done[i] = True
        if on_step is not None:
            on_step(new)
    return outputs


RUN_DIR_ENV = "TRTPIPE_MPI_RUN_DIR"  # set by trtpipe serve's leader-mode launch; rank 0 reports there


def start_leader(engine_dir: str, run_dir: str) -> MpiStepEngine:
    """Rank 0 inside the Triton twin: load its shard with the others, write every rank's status to
    ``run_dir/ranks.json`` (the launcher's readiness and failure report), return the engine."""
    import json
    import os

    from trtpipe.runtime.distributed import load_all_ranks

    def report(statuses):
        tmp = os.path.join(run_dir, "ranks.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(statuses, fh, indent=1)
        os.replace(tmp, os.path.join(run_dir, "ranks.json"))

    model, _ = load_all_ranks(os.path.join(engine_dir, "checkpoint"), on_status=report)
    return MpiStepEngine(model)
