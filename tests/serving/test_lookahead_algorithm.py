"""Lookahead decoding's state machine (trtpipe.serving.lookahead) against hand-computed cases and a model-free target.

The target here is a deterministic order-2 token chain (the next token is a function of the last two): greedy decoding
of it is known exactly, and every draft row's "logits" are that function of the row's own path, as a target forward
with the step's mask and positions computes them."""

from __future__ import annotations

import pytest

from trtpipe.serving.lookahead import (
    LookaheadAlgorithm,
    LookaheadConfig,
    NgramPool,
    positions_to_mask,
    tree_encode,
)


def test_resource_is_upstreams_formula():
    # calculateSpeculativeResourceTuple: (N - 2) + (W - 1 + G) * (N - 1) drafts, one more decoding token, path N
    assert LookaheadConfig(4, 3, 4).resource() == (16, 3, 15, 2)
    assert LookaheadConfig(5, 5, 5).max_draft_len == 3 + 9 * 4
    assert LookaheadConfig(1, 1, 0).resource() == (1, 1, 0, 0)
    assert LookaheadConfig(3, 2, 0).max_draft_len == 2


def test_legality_and_fit():
    assert LookaheadConfig(4, 3, 4).problems() == []
    assert LookaheadConfig(2, 1, 0).problems() == ["ngram size 1 requires window size 1"]
    assert LookaheadConfig(1, 1, 1).problems() == ["ngram size 1 requires verification set size 0"]
    assert LookaheadConfig(0, 3, 0).problems() == ["window size must be >= 1"]
    assert LookaheadConfig(3, 3, 3).fits_in(LookaheadConfig(3, 3, 3))
    assert not LookaheadConfig(3, 4, 3).fits_in(LookaheadConfig(3, 3, 3))
    with pytest.raises(ValueError, match=r"exceeds the executor's \(w 3, n 3, g 3\)"):
        LookaheadAlgorithm(LookaheadConfig(3, 3, 3)).setup([1, 2, 3], LookaheadConfig(4, 3, 3))


def test_pool_keeps_the_most_recent_distinct_ngrams_per_key():
    pool = NgramPool(2)
    pool.accept([1, 2, 3, 1, 4, 5, 1, 2, 3], 3)  # keys 1: (2,3), (4,5), (2,3) again -> moved last
    assert pool.guess(1, 2) == [(4, 5), (2, 3)]
    pool.insert_one(1, (6, 7))  # full: the oldest goes
    assert pool.guess(1, 5) == [(2, 3), (6, 7)]
    assert pool.guess(1, 1) == [(6, 7)]
    assert pool.guess(9, 2) == []
    assert NgramPool(0).guess(1, 2) == [] and not (NgramPool(0).insert_one(1, (2,)))


def test_mask_from_positions_is_runs_of_consecutive_positions():
    # prefill chain at 10, 11; window rows at 12.. and 13..; a guess from 10
    m = positions_to_mask([10, 11, 12, 13, 13, 10, 11])
    rows = [[j for j, v in enumerate(r) if v] for r in m]
    assert rows == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [5], [5, 6]]
    with pytest.raises(ValueError, match="consecutive"):
        positions_to_mask([10, 12])


def test_tree_encode_merges_shared_prefixes():
    tokens, positions = [7, 8, 7, 9, 7, 8, 5], [20, 21, 20, 21, 20, 21, 22]
    t, p, m, emap = tree_encode(tokens, positions, positions_to_mask(positions))
    assert t == [7, 8, 5, 9] and p == [20, 21, 22, 21]
    assert [[j for j, v in enumerate(r) if v] for r in m] == [[0], [0, 1], [0, 1, 2], [0, 3]]
    assert emap == [0, 1, 0, 3, 0, 1, 2]


def next_token(a: int, b: int, vocab: int = 11) -> int:
    """An order-2 deterministic chain: its greedy continuation cycles, so a pool of seen n-grams predicts it."""
    return (3 * a + 5 * b + 1) % vocab


def greedy(prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(next_token(seq[-2], seq[-1]))
    return seq[len(prompt) :]


def run_lookahead(prompt: list[int], steps: int, cfg: LookaheadConfig, max_cfg=None):
    """Decode ``steps`` tokens as the decoding layer drives the algorithm; returns (tokens, forwards, checks made)."""
    algo = LookaheadAlgorithm(max_cfg or cfg)
    algo.setup(prompt, cfg, seed=7)
    seq = list(prompt)
    first = next_token(seq[-2], seq[-1])  # the context step: one token, no drafts
    algo.accept([first])
    seq.append(first)
    forwards = 1
    drafts = algo.prepare(len(seq), seq[-1])
    while len(seq) - len(prompt) < steps:
        forwards += 1
        n = len(drafts.tokens)
        assert n <= cfg.max_draft_len
        if n == 0:
            tok = next_token(seq[-2], seq[-1])
            algo.accept([tok])
            seq.append(tok)
        else:
            # each row's context: the sequence, then its own path (ancestors by the mask), at consecutive positions
            for i in range(n):
                path = [j for j in range(n) if drafts.mask[i][j]]
                assert path[-1] == i and drafts.positions[i] == len(seq) + len(path) - 1
            rows = [next_token(seq[-2], seq[-1])]
            for i in range(n):
                ctx = seq + [drafts.tokens[j] for j in range(n) if drafts.mask[i][j]]
                rows.append(next_token(ctx[-2], ctx[-1]))
            accepted, offsets = algo.update(rows)
            assert len(offsets) == len(accepted) - 1 <= cfg.ngram_size - 1
            assert [drafts.tokens[j] for j in offsets] == accepted[:-1][: len(offsets)] or not offsets
            seq += accepted
        drafts = algo.prepare(len(seq), seq[-1])
    return seq[len(prompt) :][:steps], forwards


@pytest.mark.parametrize("cfg", [LookaheadConfig(4, 3, 4), LookaheadConfig(3, 4, 2), LookaheadConfig(2, 2, 1)])
def test_output_is_greedy_and_takes_fewer_forwards(cfg):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    out, forwards = run_lookahead(prompt, 60, cfg)
    assert out == greedy(prompt, 60)
    assert forwards < 60  # the chain cycles: pooled n-grams are accepted (more than one token per forward)


def test_a_request_below_the_executors_sizes_drafts_no_more_than_its_own():
    cfg = LookaheadConfig(2, 3, 1)
    out, _ = run_lookahead([4, 4, 1, 9], 30, cfg, max_cfg=LookaheadConfig(5, 5, 5))
    assert out == greedy([4, 4, 1, 9], 30)


def test_update_refuses_a_wrong_number_of_rows():
    algo = LookaheadAlgorithm(LookaheadConfig(3, 3, 2))
    algo.setup([1, 2, 3, 1, 2])
    algo.accept([3])
    d = algo.prepare(6, 3)
    with pytest.raises(ValueError, match="sampled tokens"):
        algo.update([0] * len(d.tokens))


def test_full_mask_lets_every_draft_attend_the_last_token():
    algo = LookaheadAlgorithm(LookaheadConfig(2, 3, 1))
    algo.setup([5, 6, 7, 5, 6])
    algo.accept([7])
    d = algo.prepare(6, 7)
    full = d.full_mask()
    assert len(full) == len(d.tokens) + 1 and all(row[0] for row in full)
    assert full[0] == [True] + [False] * len(d.tokens)


@pytest.mark.parametrize(
    "text, positions, size",
    [  # upstream's treeEncodeTest vectors and trie sizes (cpp/tests/unit_tests/layers/lookaheadAlgorithmTest.cpp@28190dcb)
        ("01234512345", [10, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15], 6),
        ("01234512abc", [10, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15], 9),
        ("01234512abc2aBCD", [10, 11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 12, 13, 14, 15, 16], 12),
        ("wmplhi  folxamp", [21, 22, 23, 24, 25, 26, 27, 21, 22, 23, 24, 21, 22, 23, 24], 15),
    ],
)
def test_tree_encode_on_upstreams_vectors(text, positions, size):
    tokens = [ord(c) for c in text]
    t, p, m, emap = tree_encode(tokens, positions, positions_to_mask(positions))
    assert len(t) == size
    assert [t[emap[i]] for i in range(len(tokens))] == tokens  # every input token is the node it merged into
    assert all(p[i] == positions[0] + sum(m[i]) - 1 for i in range(size))  # a node's position is its depth


# upstream's predict grid (the same test file): max (W, N, G) and a request's (w, n, g) at or below it
GRID = [
    ((1, 1, 0), (1, 1, 0)),
    ((1, 2, 0), (1, 2, 0)),
    ((2, 2, 0), (2, 2, 0)),
    ((1, 2, 1), (1, 2, 1)),
    ((2, 2, 2), (2, 2, 2)),
    ((5, 5, 5), (5, 5, 5)),
    ((7, 7, 7), (3, 2, 2)),
    ((5, 5, 5), (3, 3, 0)),
    ((7, 4, 4), (5, 3, 3)),
]


@pytest.mark.parametrize("max_cfg, cfg", GRID)
def test_upstreams_grid_decodes_the_greedy_sequence(max_cfg, cfg):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    out, forwards = run_lookahead(prompt, 48, LookaheadConfig(*cfg), max_cfg=LookaheadConfig(*max_cfg))
    assert out == greedy(prompt, 48)
    assert forwards <= 48


def test_pool_on_upstreams_fill_and_update_vectors():
    """upstream's LookaheadPoolManagerTest.fillAndUpdate (cpp/tests/unit_tests/layers/lookaheadPoolManagerTest.cpp
    @16d2467e): W 5, N 4, G 5 over characters."""

    def s(text):
        return [ord(c) for c in text]

    def rows(text):
        return [s(text[i : i + 3]) for i in range(0, 15, 3)]

    def guess(key):
        return ["".join(map(chr, g)) for g in pool.guess(ord(key), 5)]

    pool = NgramPool(5)
    pool.accept(s("hello world; hello world. live is life."), 4)
    assert guess("l") == ["lo ", "o w", "d. ", "ive", "ife"]
    assert guess(" ") == ["hel", "wor", "liv", "is ", "lif"]
    keys = s("lvwxy")
    pool.update(keys, rows("abcde12345hijkm"))
    assert guess("w") == ["orl", "234"]
    assert guess("l") == ["o w", "d. ", "ive", "ife", "abc"]
    for past in ("dogde12345hijkm", "catde12345hijkm", "abcde12345hijkm"):
        pool.update(keys, rows(past))
    assert guess("l") == ["ive", "ife", "dog", "cat", "abc"]
