"""KV events from the block pool's reuse tree (what a KV-aware router indexes), and Dynamo's request translation.

The events must describe the pool exactly: a block is *stored* when it enters the reuse tree, with its parent's
identity; *removed* when it is evicted (descendants first); an identity is unique per prefix and stable from
stored to removed, even when the pool hands the same block id to another prefix later."""

from __future__ import annotations

import pytest

from trtpipe.serving.api import FinishReason
from trtpipe.serving.dynamo_requests import FINISH, RequestRefused, translate
from trtpipe.serving.kv_events import EventRecorder, Removed, Stored, block_hash
from trtpipe.serving.kv_pool import BlockPool

B = 4


def drain(rec: EventRecorder) -> list:
    out = []
    while not rec.events.empty():
        out.append(rec.events.get())
    return out


def serve(pool: BlockPool, prompt: list[int]) -> list[int]:
    """What the executor does for one request: take the cached prefix, grow, compute, store, release."""
    table = pool.take_prefix(prompt)
    pool.grow(table, len(prompt), prompt=True)
    pool.store(table, prompt)
    pool.release(table)
    return table


def test_stored_events_chain_on_the_parent_and_only_full_blocks():
    pool, rec = BlockPool(16, B, enable_reuse=True), EventRecorder()
    pool.listener = rec
    prompt = list(range(10))  # two full blocks and a partial one
    serve(pool, prompt)
    events = drain(rec)
    assert events == [
        Stored((0, 1, 2, 3), block_hash(None, (0, 1, 2, 3)), None),
        Stored((4, 5, 6, 7), block_hash(events[0].block_hash, (4, 5, 6, 7)), events[0].block_hash),
    ]
    serve(pool, prompt)  # the same prompt again: reused, nothing new is stored
    assert drain(rec) == [] and pool.stats().reused_blocks == 2


def test_identity_is_per_prefix_not_per_block_tokens():
    a, b = block_hash(None, (1, 2, 3, 4)), block_hash(None, (9, 9, 9, 9))
    assert block_hash(a, (5, 6, 7, 8)) != block_hash(b, (5, 6, 7, 8))
    assert 0 <= a < 2**63 and block_hash(None, (1, 2, 3, 4)) == a  # fits a signed 64-bit int; deterministic


def test_eviction_removes_descendants_first_with_the_identities_they_were_stored_with():
    pool, rec = BlockPool(3, B, enable_reuse=True), EventRecorder()
    pool.listener = rec
    serve(pool, list(range(9)))  # blocks 0 -> 1 stored (third block partial, private)
    stored = drain(rec)
    assert [type(e) for e in stored] == [Stored, Stored]
    serve(pool, [50 + i for i in range(12)])  # needs all three blocks: the cached chain is evicted
    events = drain(rec)
    removed = [h for e in events if isinstance(e, Removed) for h in e.block_hashes]
    assert removed == [stored[1].block_hash, stored[0].block_hash]  # the leaf before its parent
    first_store = next(i for i, e in enumerate(events) if isinstance(e, Stored))
    assert all(isinstance(e, Removed) for e in events[:first_store]) and len(events) - first_store == 3
    assert rec.cached_blocks() == 3


def test_translate_greedy_by_default_and_end_id_from_the_request():
    r = translate(
        {
            "token_ids": [1, 2, 3],
            "stop_conditions": {"max_tokens": 5},
            "eos_token_ids": [2],
            "sampling_options": {"temperature": None},
        },
        eos_id=9,
        max_seq_len=64,
    )
    assert (r.prompt, r.max_new_tokens, r.end_id, r.sampling.greedy, r.streaming) == ([1, 2, 3], 5, 2, True, True)
    assert translate({"token_ids": [1], "stop_conditions": {"ignore_eos": True}}, 9, 8).end_id is None
    assert translate({"token_ids": [1, 2]}, 9, 8).max_new_tokens == 6  # up to max_seq_len
    assert FINISH[FinishReason.CANCELLED] == "cancelled" and FINISH[FinishReason.END_ID] == "stop"


@pytest.mark.parametrize(
    "request_, words",
    [
        ({"token_ids": []}, "no prompt tokens"),
        ({"token_ids": [1], "sampling_options": {"n": 2}}, "n=2 is not supported"),
        ({"token_ids": [1], "stop_conditions": {"min_tokens": 3}}, "min_tokens=3"),
        ({"token_ids": [1], "output_options": {"logprobs": 1}}, "logprobs=1"),
        ({"token_ids": [1] * 8}, "max_seq_len is 8"),
        ({"token_ids": [1], "stop_conditions": {"max_tokens": 0}}, "max_tokens must be in [1, 7]"),
        ({"token_ids": [1], "sampling_options": {"temperature": float("nan")}}, "temperature must be a finite number"),
        ({"token_ids": [1], "sampling_options": {"temperature": 1.0, "seed": 2**64}}, "seed must be in [0, 2^64)"),
    ],
)
def test_translate_refuses_what_the_executor_cannot_honour(request_, words):
    with pytest.raises(RequestRefused, match=None) as exc:
        translate(request_, eos_id=2, max_seq_len=8)
    assert words in str(exc.value)
