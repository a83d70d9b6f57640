"""The step engine split over MPI ranks (leader mode): rank 0's executor calls ``step(batch)``; the batch is
broadcast; every rank runs its shard of the same packed step (the reference engine's packing and paged
attention) on its own KV pool; tokens come back on rank 0.

Workers (ranks > 0) run :func:`worker_loop`: they hold no scheduling state, only their KV pool, and do whatever
rank 0 broadcasts (``allocate``, ``step``, ``copy``, ``stop``), so a dead worker means a dead job, not a confused
one. Sampling happens on rank 0 (it holds each request's seeded generator).

A speculative draft model can be sharded the same way (:func:`draft_step_engine`): every rank also loads its shard
of the draft checkpoint, each broadcast names the model it is for (``target`` or ``draft``), and one lock orders the
two engines' broadcasts on the one communicator.

Hidden-state heads (MTP, EAGLE-3, Medusa; :mod:`trtpipe.serving.hidden_draft`) draft on rank 0 from the hidden
states its own shard's forward keeps (:attr:`RankEngine.captures_hidden_states`: pp 1, no attention DP); the head runs
whole there, not tp-sharded as TensorRT-LLM builds it (docs/reference/speculative.md says why).

Under attention data parallel each step's entries are spread over the ranks (:mod:`trtpipe.serving.attention_dp`:
rank 0 assigns, the assignment is broadcast with the step, each rank runs its own entries).
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from trtpipe.runtime.distributed import RankModel
from trtpipe.serving import attention_dp
from trtpipe.serving.api import SamplingParams, StepBatch, StepEntry, StepResult
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.serving.tree_verify import as_mask


def wire(batch: StepBatch, lora_sources: Optional[dict] = None) -> tuple:
    """What the workers need of a step (no sampling state: rank 0 samples); with LoRA, each entry's adapter and
    where the step's adapters come from (name -> directory, or a source tuple: :meth:`MpiStepEngine.lora_sources`;
    a worker reads one the first time it needs it)."""
    paths = dict(sorted(lora_sources.items())) if lora_sources else {}
    return (
        batch.iteration,
        paths,
        [
            (
                e.request_id,
                list(map(int, e.tokens)),
                int(e.start_pos),
                list(map(int, e.block_table)),
                bool(e.is_context),
                bool(e.sample),
                list(map(int, e.prompt_targets)),  # which positions need logits (prompt logprobs)
                e.lora,
                None if e.spec_positions is None else list(map(int, e.spec_positions)),
                None if e.spec_mask is None else as_mask(e.spec_mask, len(e.tokens)).tolist(),
                int(e.context_drafts),  # a context chunk ending with external drafts needs their k + 1 rows
            )
            for e in batch.entries
        ],
    )


def unwire(wire: tuple) -> StepBatch:
    iteration, _, entries = wire
    return StepBatch(
        iteration,
        [
            StepEntry(*e[:6], prompt_targets=e[6], lora=e[7], spec_positions=e[8], spec_mask=e[9], context_drafts=e[10])
            for e in entries
        ],
    )


class RankEngine(ReferenceEngine):
    """Every rank's shard of a packed step: the reference engine's packing and paged pool (this rank's KV heads
    of its stage's layers), run through :meth:`RankModel.forward` (all-reduces, pipeline sends)."""

    def __init__(self, model: RankModel):
        super().__init__(model)

    @property
    def captures_hidden_states(self) -> bool:
        """Rank 0 of a pp 1 job without attention DP holds every layer's whole output after its all-reduce, so it
        keeps the hidden states a head drafts from (:mod:`trtpipe.serving.hidden_draft`); at pp > 1 they are on
        other ranks, under attention DP only its own requests' are."""
        lay = self.model.layout
        return lay.rank == 0 and lay.pp == 1 and not self.model.args.attention_dp

    @torch.no_grad()
    def logits(self, batch: StepBatch, ranks: Optional[list[int]] = None) -> Optional[torch.Tensor]:
        """``ranks``: under attention DP, the rank of each entry (rank 0's :class:`~attention_dp.RankAssigner`)."""
        if self.model.args.attention_dp:
            return attention_dp.step_logits(self, batch, ranks)
        ids, paged, cos_sin, ends = self.packed(batch)
        self.model.capture = self.capture
        out = self.model.forward(ids, paged, 0, rows=torch.tensor(ends, dtype=torch.long), cos_sin=cos_sin)
        self.captured = self.model.captured
        return out


TARGET, DRAFT = "target", "draft"


def worker_loop(model: RankModel, draft: Optional[RankModel] = None) -> None:
    """A worker rank: follow rank 0's broadcasts (allocate, step, copy, lora), each for the target or the draft
    model, until ``stop``. Adapters attach to the target only."""
    engines = {TARGET: RankEngine(model), **({DRAFT: RankEngine(draft)} if draft is not None else {})}
    lora = None
    while True:
        kind, *rest = model.comm.bcast(None)
        if kind == "stop":
            return
        tag, *rest = rest
        engine = engines[tag]
        if kind == "step":
            batch = unwire(rest[0])
            if lora is not None and tag == TARGET:
                lora.run(batch, rest[0][1], engine.logits)
            else:
                engine.logits(batch, *rest[1:])  # rest[1]: each entry's rank, under attention DP
        elif kind == "lora":  # rank 0 serves LoRA adapters (trtpipe.serving.adapters.LoraStepEngine)
            from trtpipe.serving.adapters import RankLora

            lora = RankLora(model, *rest)
        elif kind == "allocate":
            engine.allocate(*rest)
        elif kind == "copy":
            engine.copy_block(*rest)
        elif kind == "move":  # a masked verification's accepted drafts (trtpipe.serving.tree_verify)
            engine.move_slots(*rest)


class MpiStepEngine(RankEngine):
    """The :class:`~trtpipe.serving.api.StepEngine` of rank 0: broadcast each call, run its own shard, sample.

    One lock covers each broadcast and the collective work after it, so :meth:`shutdown` (from another thread)
    never interleaves with a step on the same communicator.
    """

    def __init__(self, model: RankModel, tag: str = TARGET, lock: Optional[threading.Lock] = None):
        if model.layout.rank != 0:
            raise ValueError("MpiStepEngine runs on rank 0; other ranks run worker_loop")
        super().__init__(model)
        self.stopped = False
        self.tag = tag
        self._lock = lock or threading.Lock()
        self.lora_cache = None  # with LoRA: rank 0's adapter cache (the step's adapters: step_adapters)
        self.step_adapters: dict = {}  # name -> LoraAdapter of the coming step (set by LoraStepEngine)
        self._shipped: dict = {}  # name -> version of the sent tensors the workers already hold
        self.assigner = attention_dp.RankAssigner(model.layout.tp) if model.args.attention_dp else None

    def configure_lora(self, cache, reader=None) -> None:
        """Serve LoRA: every worker attaches adapters to its shards with ``cache``'s bounds
        (:class:`~trtpipe.serving.adapters.RankLora`); each step then names where its adapters come from.
        ``reader``: how a worker reads adapters that are not PEFT directories (the Triton twin's
        :class:`~trtpipe.serving.triton_lora.Rows`)."""
        with self._lock:
            self._broadcast("lora", cache.layout, cache.max_loras, cache.max_cpu_loras, cache.max_rank, reader)
            self.lora_cache = cache

    def lora_sources(self, batch: StepBatch) -> Optional[dict]:
        """Name -> source of the step's adapters: a PEFT directory (str), a prefetched task
        ``("npy", task, folder)``, or tensors sent with a request ``("sent", task, version, weights, config)``,
        whose tensors travel only the first time the workers need that version (``("sent", task, version)`` after:
        upstream broadcasts a request's LoRA tensors to every rank once; the task id names them from then on)."""
        if self.lora_cache is None:
            return None
        out = {}
        for name in {e.lora for e in batch.entries if e.lora is not None}:
            adapter = self.step_adapters.get(name)
            src = adapter.source if adapter is not None else None
            if src is None:
                out[name] = str(adapter.path if adapter is not None else self.lora_cache.paths[name])
            elif src[0] == "sent" and self._shipped.get(name) == src[2]:
                out[name] = src[:3]
            else:
                out[name] = src
                if src[0] == "sent":
                    self._shipped[name] = src[2]
        return out

    def _broadcast(self, kind: str, *args) -> None:
        if self.stopped:
            raise RuntimeError("the MPI step engine was shut down (the worker ranks are gone)")
        self.model.comm.bcast((kind, self.tag, *args))

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        with self._lock:
            self._broadcast("allocate", int(num_blocks), int(tokens_per_block))
            super().allocate(num_blocks, tokens_per_block)

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        with self._lock:
            self._broadcast("copy", int(src), int(dst), int(num_tokens))
            super().copy_block(src, dst, num_tokens)
            if self.assigner is not None:
                self.assigner.copied(src, dst)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        with self._lock:
            self._broadcast("move", list(map(int, src)), list(map(int, dst)))
            super().move_slots(src, dst)

    def logits(self, batch: StepBatch) -> torch.Tensor:
        with self._lock:
            if self.assigner is None:
                self._broadcast("step", wire(batch, self.lora_sources(batch)))
                return super().logits(batch)
            ranks = self.assigner.assign(batch, self.tokens_per_block)
            self._broadcast("step", wire(batch, self.lora_sources(batch)), ranks)
            return super().logits(batch, ranks)

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


def draft_step_engine(target: MpiStepEngine, draft: RankModel) -> MpiStepEngine:
    """Rank 0's engine of a draft model sharded over the target's ranks (the workers run
    ``worker_loop(model, draft)``): its broadcasts share the target's lock, and the target's shutdown stops both."""
    if (draft.layout.tp, draft.layout.pp) != (target.model.layout.tp, target.model.layout.pp):
        raise ValueError(
            f"draft checkpoint tp {draft.layout.tp} x pp {draft.layout.pp} must be the target's layout "
            f"(tp {target.model.layout.tp} x pp {target.model.layout.pp}): both run on the same ranks"
        )
    return MpiStepEngine(draft, DRAFT, target._lock)


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


def start_leader(engine_dir: str, run_dir: str, draft_dir: Optional[str] = None) -> MpiStepEngine:
    """Rank 0 inside the Triton twin: load its shard with the others, write every rank's status to
    ``run_dir/ranks.json`` (the launcher's readiness and failure report), return the engine. With ``draft_dir`` (the
    two-model form's draft engine) every rank also loads its draft shard, and ``engine.draft`` is the draft's engine
    (rank 0's twin serves it to the draft's stub: :class:`~trtpipe.serving.draft_proxy.DraftServer`)."""
    import json
    import os

    from trtpipe.runtime.distributed import load_all_ranks

    def report(statuses):
        tmp = os.path.join(run_dir, "ranks.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(statuses, fh, indent=1)
        os.replace(tmp, os.path.join(run_dir, "ranks.json"))

    model, _ = load_all_ranks(os.path.join(engine_dir, "checkpoint"), on_status=report)
    engine = MpiStepEngine(model)
    if draft_dir:
        engine.draft = draft_step_engine(engine, load_all_ranks(os.path.join(draft_dir, "checkpoint"), report)[0])
    return engine
