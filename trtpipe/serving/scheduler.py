"""Which active requests run this step, and how many tokens each gets: TensorRT-LLM's two schedulers.

The capacity scheduler decides who may run given KV blocks (and who is paused under MAX_UTILIZATION); the
micro-batch scheduler fits them into ``max_batch_size`` requests and ``max_num_tokens`` tokens, chunking
contexts when chunked context is on. Both are pure functions of the active list and the pool's free count:
nothing is allocated here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from trtpipe.serving.api import CapacityPolicy, ExecutorConfig, PerfMetrics, Request


@dataclass
class ActiveRequest:
    """An admitted request (``LlmRequest``): its tokens, where its context stands, and its blocks.

    ``tokens`` is the whole sequence known so far (prompt, then every generated token). A context phase
    computes the KV of ``tokens[:context_len]`` and samples the next token; after a pause under
    MAX_UTILIZATION the KV is dropped and the context phase runs again over prompt + output (recompute).
    """

    id: int
    request: Request
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int  # after the silent shortening to max_seq_len
    context_len: int = 0
    context_pos: int = 0  # positions of the context whose KV is computed
    generating: bool = False
    block_table: list[int] = field(default_factory=list)
    sent: int = 0  # output tokens already streamed
    finish_reason: int = 0
    perf: PerfMetrics = field(default_factory=PerfMetrics)
    generator: object = None
    chunk: int = 0  # context tokens scheduled this step
    num_pauses: int = 0
    matcher: object = None  # guided decoding: the request's trtpipe.serving.guided.GuideMatcher
    logprobs: list = field(default_factory=list)  # TokenLogprob per output token (Request.logprobs)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob per prompt token after the first
    cum_log_prob: float = 0.0
    generation_logits: list = field(default_factory=list)  # [V] per sampled token (Request.return_generation_logits)
    prompt_logprobs_sent: bool = False

    def __post_init__(self):
        self.context_len = self.context_len or len(self.tokens)

    @property
    def priority(self) -> float:
        return self.request.priority

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def started(self) -> bool:
        """Holds KV blocks: generating, or a context whose first chunk ran."""
        return bool(self.block_table)

    @property
    def kv_len(self) -> int:
        """Positions whose KV is in the cache (the last sampled token is fed, and cached, next step)."""
        return len(self.tokens) - 1 if self.generating else self.context_pos


def remaining_blocks(r: ActiveRequest, tokens_per_block: int, draft_reserve: int = 0) -> int:
    """Blocks this request still needs to finish: its whole budget (prompt + max new tokens, + the positions a
    verification step may hold beyond them) minus what it holds."""
    total = r.prompt_len + r.max_new_tokens + draft_reserve
    return max(0, -(-total // tokens_per_block) - len(r.block_table))


def blocks_for_next_step(r: ActiveRequest, tokens_per_block: int, draft_reserve: int = 0) -> int:
    """Blocks the next step takes: the whole context at the first chunk, else those its token (and drafts) cross
    into."""
    if not r.started:
        return -(-r.context_len // tokens_per_block)
    if not r.generating:
        return 0  # every context block was allocated with the first chunk
    return max(0, -(-(r.kv_len + 1 + draft_reserve) // tokens_per_block) - len(r.block_table))


@dataclass
class CapacityDecision:
    scheduled: list[ActiveRequest]
    paused: list[ActiveRequest]


def capacity_schedule(
    active: list[ActiveRequest],
    free_blocks: int,
    config: ExecutorConfig,
    max_requests: int,
    refs: Optional[Callable[[int], int]] = None,
) -> CapacityDecision:
    """``CapacityScheduler``: ``active`` is in priority order; ``free_blocks`` counts cached reusable blocks.

    ``refs(block)``: how many sequences hold a block (the pool's count). Pausing a request frees only the blocks
    no other request holds; without ``refs`` every block of the victim is taken as its own.
    """
    tpb = config.tokens_per_block
    if config.capacity_policy is CapacityPolicy.MAX_UTILIZATION:
        return _max_utilization(active, free_blocks, tpb, max_requests, refs or (lambda b: 1), config.draft_reserve)
    static = config.capacity_policy is CapacityPolicy.STATIC_BATCH
    available, scheduled, pending = free_blocks, [], []
    for r in active:
        if r.generating and len(scheduled) < max_requests:
            scheduled.append(r)
            available -= remaining_blocks(r, tpb, config.draft_reserve)
        elif not r.generating:
            pending.append(r)
    if static and any(r.generating for r in active):
        return CapacityDecision(scheduled, [])  # a static batch runs to completion before the next forms
    for r in pending:
        if len(scheduled) >= max_requests:
            break
        need = remaining_blocks(r, tpb, config.draft_reserve)
        if need > available:
            break  # strict head-of-line blocking: later requests wait too
        scheduled.append(r)
        available -= need
    return CapacityDecision(scheduled, [])


def _max_utilization(
    active: list[ActiveRequest],
    free_blocks: int,
    tpb: int,
    max_requests: int,
    refs: Callable[[int], int],
    draft_reserve: int = 0,
) -> CapacityDecision:
    """Admit while next-step blocks fit; on a misfit pause the last started request at or after the current one."""
    view, scheduled, paused = free_blocks, [], []
    released: dict[int, int] = {}  # block -> holders paused so far (a block shared by two victims frees with both)
    end, i = len(active), 0
    while i < end and len(scheduled) < max_requests:
        r = active[i]
        need = blocks_for_next_step(r, tpb, draft_reserve)
        if need <= view:
            scheduled.append(r)
            view -= need
            i += 1
            continue
        victim = next((j for j in range(end - 1, i - 1, -1) if active[j].started), None)
        if victim is None:
            break
        paused.append(active[victim])
        for b in active[victim].block_table:  # only blocks that no request left running still holds come free
            released[b] = released.get(b, 0) + 1
            view += released[b] == refs(b)
        end = victim
    return CapacityDecision(scheduled, paused)


class ContextTooLong(RuntimeError):
    """A context larger than ``max_context_length`` reached the micro-batch scheduler (the step would throw)."""

    def __init__(self, message: str, request_id: int):
        super().__init__(message)
        self.request_id = request_id


def micro_batch(scheduled: list[ActiveRequest], config: ExecutorConfig) -> list[ActiveRequest]:
    """``MicroBatchScheduler``: the requests of this step, with ``chunk`` set on each context request."""
    order = scheduled
    if config.capacity_policy is not CapacityPolicy.MAX_UTILIZATION:
        order = [r for r in scheduled if r.generating] + [r for r in scheduled if not r.generating]
    budget, chosen, to_chunk = config.max_num_tokens, [], []
    used = 0
    for r in order:
        if r.generating:  # its token, and the drafts it may verify
            if used + 1 + config.draft_reserve > budget:
                break
            used += 1 + config.draft_reserve
        elif not config.enable_chunked_context:
            need = r.context_len - r.context_pos
            if need > config.max_context_length:
                raise ContextTooLong(
                    f"context of {need} tokens exceeds max_context_length {config.max_context_length}", r.id
                )
            if used + need > budget:
                break
            used += need
            r.chunk = need
        else:
            to_chunk.append(r)
        chosen.append(r)
        if len(chosen) >= config.max_batch_size:
            break
    if to_chunk:
        _chunk_fcfs(to_chunk, budget - used, config)
        chosen = [r for r in chosen if r.generating or r.chunk > 0]
    return chosen


def _chunk_fcfs(contexts: list[ActiveRequest], budget: int, config: ExecutorConfig) -> None:
    """FIRST_COME_FIRST_SERVED chunk sizes: in order, as much as fits, cut to a multiple of the chunk unit.

    Every chunk but a context's last ends on a block boundary, so the unit is counted from the context's
    current position (which is block-aligned after a reused prefix or an earlier chunk).
    """
    unit = config.tokens_per_block
    for r in contexts:
        remaining = r.context_len - r.context_pos
        size = min(remaining, budget, config.max_context_length)
        if size < remaining:
            size = size // unit * unit
        r.chunk = size
        budget -= size


def insert_by_priority(items: list, item, priority: Optional[float] = None) -> None:
    """Insert after every element whose priority is >= this one's (``insertRequestInOrder``: FIFO among equals)."""
    p = item.priority if priority is None else priority
    i = len(items)
    while i > 0 and items[i - 1].priority < p:
        i -= 1
    items.insert(i, item)
