"""The step engine split over MPI ranks (leader mode): rank 0's executor calls ``step(batch)``; the batch is
broadcast; every rank runs its shard of the same packed step (the reference engine's packing and paged
attention) on its own KV pool; tokens come back on rank 0.

Workers (ranks > 0) run :func:`worker_loop`: they hold no scheduling state, only their KV pool, and do whatever
rank 0 broadcasts (``allocate``, ``step``, ``copy``, ``stop``), so a dead worker means a dead job, not a confused
one. Sampling happens on rank 0 (it holds each request's seeded generator).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from trtpipe.runtime.distributed import RankModel
from trtpipe.serving.api import SamplingParams, StepBatch, StepEntry, StepResult
from trtpipe.serving.reference_engine import ReferenceEngine


def _wire(batch: StepBatch) -> tuple:
    """What the workers need of a step (no sampling state: rank 0 samples)."""
    return batch.iteration, [
        (
            e.request_id,
            list(map(int, e.tokens)),
            int(e.start_pos),
            list(map(int, e.block_table)),
            bool(e.is_context),
            bool(e.sample),
            list(map(int, e.prompt_targets)),  # which positions need logits (prompt logprobs)
        )
        for e in batch.entries
    ]


def _unwire(wire: tuple) -> StepBatch:
    iteration, entries = wire
    return StepBatch(iteration, [StepEntry(*e[:6], prompt_targets=e[6]) for e in entries])


class RankEngine(ReferenceEngine):
    """Every rank's shard of a packed step: the reference engine's packing and paged pool (this rank's KV heads
    of its stage's layers), run through :meth:`RankModel.forward` (all-reduces, pipeline sends)."""

    captures_hidden_states = False  # its logits run over the ranks: MTP / EAGLE-3 heads get no hidden states

    def __init__(self, model: RankModel):
        super().__init__(model)

    @torch.no_grad()
    def logits(self, batch: StepBatch) -> Optional[torch.Tensor]:
        ids, paged, cos_sin, ends = self.packed(batch)
        return self.model.forward(ids, paged, 0, rows=torch.tensor(ends, dtype=torch.long), cos_sin=cos_sin)


def worker_loop(model: RankModel) -> None:
    """A worker rank: follow rank 0's broadcasts (allocate, step, copy) until ``stop``."""
    engine = RankEngine(model)
    while True:
        kind, *rest = model.comm.bcast(None)
        if kind == "stop":
            return
        if kind == "step":
            engine.logits(_unwire(rest[0]))
        elif kind == "allocate":
            engine.allocate(*rest)
        elif kind == "copy":
            engine.copy_block(*rest)


class MpiStepEngine(RankEngine):
    """The :class:`~trtpipe.serving.api.StepEngine` of rank 0: broadcast each call, run its own shard, sample.

    One lock covers each broadcast and the collective work after it, so :meth:`shutdown` (from another thread)
    never interleaves with a step on the same communicator.
    """

    def __init__(self, model: RankModel):
        if model.layout.rank != 0:
            raise ValueError("MpiStepEngine runs on rank 0; other ranks run worker_loop")
        super().__init__(model)
        self.stopped = False
        self._lock = threading.Lock()

    def _broadcast(self, command: tuple) -> None:
        if self.stopped:
            raise RuntimeError("the MPI step engine was shut down (the worker ranks are gone)")
        self.model.comm.bcast(command)

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        with self._lock:
            self._broadcast(("allocate", int(num_blocks), int(tokens_per_block)))
            super().allocate(num_blocks, tokens_per_block)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        with self._lock:
            self._broadcast(("copy", int(src), int(dst), int(num_tokens)))
            super().copy_block(src, dst, num_tokens)

    def logits(self, batch: StepBatch) -> torch.Tensor:
        with self._lock:
            self._broadcast(("step", _wire(batch)))
            return super().logits(batch)

    def step(self, batch: StepBatch) -> StepResult:
        if not batch.entries:
            return StepResult({}, 0.0)
        return super().step(batch)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Release the workers (they return from :func:`worker_loop`) once no step is in flight."""
        if self._lock.acquire(timeout=timeout):
            try:
                if not self.stopped:
                    self.model.comm.bcast(("stop",))
            finally:
                self.stopped = True
                self._lock.release()


def generate_steps(
    engine,
    prompts: list[list[int]],
    max_new_tokens: int,
    end_ids=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    stop_words=None,
    on_step: Optional[Callable[[list], None]] = None,
    tokens_per_block: int = 64,
) -> list[list[int]]:
    """:func:`trtpipe.runtime.generate` semantics over a step engine: the prompts prefill in one step, then
    every step decodes all unfinished sequences. Each sequence gets contiguous blocks of a pool allocated for
    this call. (A static batch: the in-flight executor replaces this for serving.)
    """
    from trtpipe.runtime.generate import accept_step, per_sequence

    n = len(prompts)
    ends, stops = per_sequence(end_ids, n, 0), per_sequence(stop_words, n, 1)
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
        entries = [
            StepEntry(
                i,
                list(prompts[i]) if it == 0 else [outputs[i][-1]],
                0 if it == 0 else len(prompts[i]) + len(outputs[i]) - 1,
                tables[i],
                it == 0,
                True,
                params,
                gens[i],
            )
            for i in rows
        ]
        got = engine.step(StepBatch(it, entries)).tokens
        new: list = [None] * n
        accept_step({i: got[i] for i in rows}, outputs, done, new, ends, stops, max_new_tokens)
        if on_step is not None:
            on_step(new)
    return outputs


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
