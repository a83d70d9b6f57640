"""KV block events for a prefix-aware router: which cached blocks a worker holds, as *stored* / *removed* events.

A KV-aware router (NVIDIA Dynamo's ``--router-mode kv``) keeps a radix tree of every worker's reusable blocks and
sends a request to the worker whose cache holds the longest prefix of it. It learns the tree from events the
worker publishes: a block *stored* (it became reusable: its tokens, its parent block) and blocks *removed*
(evicted). Dynamo matches on a hash of each block's tokens that it computes itself; the worker's block hashes are
only identities, for parent links and removals (ai-dynamo 1.6.1 ``lib/llm/src/kv_router/publisher.rs``,
``create_stored_block_from_parts``). So an identity here must be unique per *prefix* (chained on the parent's) and
stable from stored to removed: :func:`block_hash` is a 63-bit blake2b of the parent's hash and the block's tokens,
as Dynamo's own example engine (``examples/custom_backend/hello_world``) does.

:class:`EventRecorder` is the pool's :class:`~trtpipe.serving.kv_pool.ReuseListener`: it turns block ids (which
the pool reuses after eviction) into those identities and queues events in order; a publisher drains the queue
on its own thread, so the executor thread never waits on the network.
"""

from __future__ import annotations

import hashlib
import queue
import struct
from dataclasses import dataclass
from typing import Optional, Sequence


def block_hash(parent: Optional[int], tokens: Sequence[int]) -> int:
    """The identity of a block: its tokens after everything before it, as a non-negative signed-64-bit int."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent is None else parent))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little") >> 1


@dataclass(frozen=True)
class Stored:
    tokens: tuple
    block_hash: int
    parent_hash: Optional[int]


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple


class EventRecorder:
    """Block ids -> prefix identities, and the ordered queue of :class:`Stored` / :class:`Removed` events."""

    def __init__(self) -> None:
        self._hash: dict[int, int] = {}  # block id -> identity while the block is in the reuse tree
        self.events: queue.SimpleQueue = queue.SimpleQueue()

    def stored(self, block_id: int, tokens: tuple, parent_id: Optional[int]) -> None:
        parent = None if parent_id is None else self._hash[parent_id]
        self._hash[block_id] = h = block_hash(parent, tokens)
        self.events.put(Stored(tokens, h, parent))

    def removed(self, block_ids: Sequence[int]) -> None:
        self.events.put(Removed(tuple(self._hash.pop(b) for b in block_ids)))

    def cached_blocks(self) -> int:
        return len(self._hash)
