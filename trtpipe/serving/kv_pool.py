"""The paged KV block pool: which blocks are free, who holds which, and which cached prefixes can be reused.

Accounting follows TensorRT-LLM's ``KVCacheManager`` (1.x):
- a request's blocks form its block table; a block may be shared (reference counted) when a prefix is reused;
- "free" blocks are the blocks nobody holds, **including cached reusable ones**: those are evicted on demand,
  so reuse never makes a request less schedulable;
- free blocks leave in LRU order (one retention priority here; TensorRT-LLM keeps a queue per priority);
  released blocks go to the back, a sequence's blocks are released last block first (leaves before parents);
- reusable blocks live in a radix tree keyed by their tokens; a block's identity is its tokens *and* every
  block before it, so matching walks from the root; only full blocks match, and the last prompt token is never
  taken from the cache (at least one token is always computed);
- a block's identity also holds the LoRA adapter that computed it (``salt``: one tree per adapter, as TensorRT-LLM's
  ``BlockKey`` carries ``loraTaskId`` and ``numMatchingTokens`` matches nothing across two task ids,
  ``cpp/include/tensorrt_llm/batch_manager/blockKey.h@2bb816c6``): two adapters never share a cached block.

Storage lives in the step engine; this module only hands out block ids. A block holds every KV layer of its
positions, a hidden-state head's too (:mod:`trtpipe.serving.hidden_draft`), so a reused block brings them all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence


class PoolExhausted(RuntimeError):
    """More blocks asked for than are free: a scheduler bug, since schedulers check before allocating."""


class ReuseListener(Protocol):
    """Told when a block enters or leaves the reuse tree: the KV events a router builds its prefix index from
    (TensorRT-LLM's ``KVCacheEventManager``: *stored* when a block becomes reusable, *removed* when it is evicted,
    not when its request ends). Called on the executor thread, with the pool mid-update: record, don't call back."""

    def stored(self, block_id: int, tokens: tuple, parent_id: Optional[int]) -> None: ...

    def removed(self, block_ids: Sequence[int]) -> None: ...


@dataclass
class _Block:
    id: int
    refs: int = 0
    key: Optional[tuple] = None  # this block's tokens while it is in the reuse tree
    parent: Optional["_Block"] = None
    children: dict = field(default_factory=dict)  # key -> _Block


@dataclass
class KVStats:
    """``KvCacheStats``: counters are cumulative since start, as the backend reports them."""

    max_blocks: int
    free_blocks: int
    used_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cached_blocks: int

    @property
    def cache_hit_rate(self) -> float:
        seen = self.reused_blocks + self.missed_blocks
        return self.reused_blocks / seen if seen else 0.0

    @property
    def fraction_used(self) -> float:
        return self.used_blocks / self.max_blocks if self.max_blocks else 0.0


class BlockPool:
    """``num_blocks`` blocks of ``tokens_per_block`` tokens; prefix reuse when ``enable_reuse``."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = False):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ValueError(
                f"KV pool needs at least one block of at least one token, got {num_blocks} x {tokens_per_block}"
            )
        self.num_blocks, self.tokens_per_block, self.enable_reuse = num_blocks, tokens_per_block, enable_reuse
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front = evicted first
        self._roots: dict = {None: _Block(-1)}  # salt (LoRA adapter) -> its reuse tree
        self.alloc_total = self.alloc_new = self.reused = self.missed = 0
        self.listener: Optional[ReuseListener] = None

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def refs(self, block_id: int) -> int:
        return self._blocks[block_id].refs

    def stats(self) -> KVStats:
        cached = sum(1 for b in self._blocks if b.key is not None)
        return KVStats(
            self.num_blocks,
            self.num_free,
            self.num_blocks - self.num_free,
            self.tokens_per_block,
            self.alloc_total,
            self.alloc_new,
            self.reused,
            self.missed,
            cached,
        )

    def _root(self, salt) -> _Block:
        if salt not in self._roots:
            self._roots[salt] = _Block(-1)
        return self._roots[salt]

    def match_prefix(self, prompt: Sequence[int], salt=None) -> list[int]:
        """Ids of the cached full blocks that prefix ``prompt[:-1]`` computed under ``salt`` (read-only)."""
        if not self.enable_reuse:
            return []
        tpb, node, found = self.tokens_per_block, self._roots.get(salt), []
        if node is None:
            return []
        for i in range((len(prompt) - 1) // tpb):
            node = node.children.get(tuple(prompt[i * tpb : (i + 1) * tpb]))
            if node is None:
                break
            found.append(node.id)
        return found

    # ---- allocation ------------------------------------------------------------------------------
    def take_prefix(self, prompt: Sequence[int], salt=None) -> list[int]:
        """Take the cached blocks that prefix ``prompt`` (never its last token): the start of a block table."""
        table = [self._take(b) for b in self.match_prefix(prompt, salt)]
        self.alloc_total += len(table)
        self.reused += len(table)
        return table

    def grow(self, table: list[int], num_tokens: int, prompt: bool = False) -> int:
        """Extend ``table`` with new blocks to cover ``num_tokens`` positions; returns how many were added.

        ``prompt``: these blocks hold prompt tokens the cache did not have (counted as missed).
        """
        added = 0
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._new())
            added += 1
        self.alloc_total += added
        self.alloc_new += added
        if prompt:
            self.missed += added
        return added

    def store(self, table: Sequence[int], tokens: Sequence[int], salt=None) -> None:
        """Publish the full blocks of a sequence whose KV holds ``tokens`` (position i = tokens[i]) for reuse.

        A block whose key already exists under the same parent (computed twice by two requests at once) stays
        private; the tree keeps the first.
        """
        if not self.enable_reuse:
            return
        tpb, root = self.tokens_per_block, self._root(salt)
        parent = root
        for i in range(min(len(table), len(tokens) // tpb)):
            key, block = tuple(tokens[i * tpb : (i + 1) * tpb]), self._blocks[table[i]]
            existing = parent.children.get(key)
            if existing is None and block.key is None:
                block.key, block.parent = key, parent
                parent.children[key] = block
                existing = block
                if self.listener is not None:
                    self.listener.stored(block.id, key, None if parent is root else parent.id)
            if existing is not block:
                return  # the rest of this sequence hangs off a different (private) block
            parent = block

    def release(self, table: Sequence[int]) -> None:
        """Drop a sequence's hold on its blocks, last block first (leaves become evictable before parents)."""
        for block_id in reversed(table):
            block = self._blocks[block_id]
            if block.refs <= 0:
                raise RuntimeError(f"KV block {block_id} released more often than taken")
            block.refs -= 1
            if block.refs == 0:
                self._free[block_id] = None

    # ---- internals -------------------------------------------------------------------------------
    def _take(self, block_id: int) -> int:
        block = self._blocks[block_id]
        if block.refs == 0:
            del self._free[block_id]
        block.refs += 1
        return block_id

    def _new(self) -> int:
        if not self._free:
            raise PoolExhausted(f"KV pool exhausted: all {self.num_blocks} blocks are in use")
        block_id, _ = self._free.popitem(last=False)
        self._evict(self._blocks[block_id])
        self._blocks[block_id].refs = 1
        return block_id

    def _evict(self, block: _Block) -> None:
        """Take ``block`` (and its descendants, which can no longer be reached) out of the reuse tree."""
        if block.key is None:
            return
        stack, gone = [block], []
        del block.parent.children[block.key]
        while stack:
            b = stack.pop()
            gone.append(b.id)
            stack.extend(b.children.values())
            b.children, b.key, b.parent = {}, None, None
        if self.listener is not None:
            self.listener.removed(gone[::-1])  # descendants before the block they hang off (leaves first)
