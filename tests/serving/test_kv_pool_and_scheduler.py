"""Block pool and schedulers against the executor spec's rules (pure: no model)."""

from __future__ import annotations

import pytest

from trtpipe.serving.api import CapacityPolicy, ExecutorConfig, Request
from trtpipe.serving.kv_pool import BlockPool, PoolExhausted
from trtpipe.serving.scheduler import ActiveRequest, capacity_schedule, insert_by_priority, micro_batch


def _cfg(**kw):
    base = dict(
        max_batch_size=4, max_num_tokens=32, max_input_len=64, max_seq_len=64, num_blocks=16, tokens_per_block=4
    )
    base.update(kw)
    return ExecutorConfig(**base)


def _req(rid, prompt_len, max_new=8, generating=False, blocks=(), priority=0.5):
    r = ActiveRequest(
        rid, Request(list(range(prompt_len)), max_new, priority=priority), list(range(prompt_len)), prompt_len, max_new
    )
    r.generating, r.block_table = generating, list(blocks)
    if generating:
        r.tokens.append(7)
    return r


def test_reuse_matches_full_blocks_but_never_the_last_prompt_token():
    pool = BlockPool(8, 4, enable_reuse=True)
    prompt = list(range(12))  # exactly 3 blocks
    table = pool.take_prefix(prompt)
    pool.grow(table, 12, prompt=True)
    pool.store(table, prompt)
    pool.release(table)
    assert pool.num_free == 8  # cached blocks count as free
    assert len(pool.match_prefix(prompt)) == 2  # the block holding the last token is recomputed
    assert len(pool.match_prefix(prompt + [99])) == 3
    assert pool.match_prefix([5] + prompt[1:]) == []  # a block's identity includes everything before it


def test_lru_eviction_takes_leaves_first_and_drops_unreachable_descendants():
    pool = BlockPool(4, 2, enable_reuse=True)
    seq = [1, 2, 3, 4, 5, 6]
    t = pool.take_prefix(seq)
    pool.grow(t, 6, prompt=True)
    pool.store(t, seq)
    pool.release(t)  # released last block first: the leaf is evicted first
    fresh = []
    pool.grow(fresh, 2)
    assert fresh == [3]  # the never-used block was free first
    pool.grow(fresh, 4)
    assert fresh[1] == t[2]  # then the leaf of the cached chain
    assert len(pool.match_prefix(seq + [0])) == 2
    pool.grow(fresh, 6)  # evicting the middle block drops nothing reachable but itself
    assert len(pool.match_prefix(seq + [0])) == 1


def test_pool_refuses_to_overallocate():
    pool = BlockPool(2, 4)
    t = []
    pool.grow(t, 8)
    with pytest.raises(PoolExhausted):
        pool.grow(t, 9)


def test_guaranteed_no_evict_reserves_whole_budgets_and_blocks_the_line():
    cfg = _cfg()
    running = _req(1, 8, max_new=8, generating=True, blocks=[0, 1, 2])  # needs 4 blocks in all: 1 more
    big = _req(2, 20, max_new=40)  # 15 blocks: does not fit in 16 - 3 - 1
    small = _req(3, 2, max_new=2)  # would fit, but waits behind big (head-of-line)
    d = capacity_schedule([running, big, small], free_blocks=13, config=cfg, max_requests=4)
    assert [r.id for r in d.scheduled] == [1] and d.paused == []


def test_max_utilization_pauses_the_last_started_request():
    cfg = _cfg(capacity_policy=CapacityPolicy.MAX_UTILIZATION)
    a = _req(1, 7, generating=True, blocks=[0, 1])  # kv_len 7: next token fits in block 1
    b = _req(2, 8, generating=True, blocks=[2, 3])  # kv_len 8: needs a new block
    c = _req(3, 4)  # new: needs one block
    d = capacity_schedule([a, b, c], free_blocks=0, config=cfg, max_requests=4)
    assert [r.id for r in d.scheduled] == [1] and [r.id for r in d.paused] == [2]


def test_micro_batch_stops_at_the_token_budget_and_chunks_fcfs():
    cfg = _cfg(max_num_tokens=16, enable_chunked_context=True)
    gens = [_req(i, 4, generating=True, blocks=[i]) for i in range(3)]
    long_a, long_b = _req(10, 30), _req(11, 30)
    chosen = micro_batch(gens + [long_a, long_b], cfg)
    assert [r.id for r in chosen] == [0, 1, 2, 10]
    assert long_a.chunk == 12  # 16 - 3 generation tokens = 13, cut to a multiple of 4
    assert long_b.chunk == 0
    no_chunk = micro_batch(gens + [_req(12, 14), _req(13, 2)], _cfg(max_num_tokens=16))
    assert [r.id for r in no_chunk] == [0, 1, 2]  # 3 + 14 > 16: the walk stops there


def test_micro_batch_caps_requests_at_max_batch_size():
    cfg = _cfg(max_batch_size=2)
    assert len(micro_batch([_req(i, 2) for i in range(5)], cfg)) == 2


def test_priority_insert_is_fifo_among_equals():
    items = []
    for rid, p in [(1, 0.5), (2, 0.5), (3, 0.9), (4, 0.5), (5, 0.1)]:
        insert_by_priority(items, _req(rid, 2, priority=p))
    assert [r.id for r in items] == [3, 1, 2, 4, 5]
