"""Verifying drafts as a token set (trtpipe.serving.tree_verify): a hand-built tree whose accepted path is known,
run through the paged reference engine with its mask and positions, gives the logits a plain chain forward of the
accepted path gives, and after the accepted drafts' KV moves the pool is the chain's; on every attention kind the
engine has (GQA, sliding window, gpt-oss sinks, Gemma 3's local/global ropes, MLA latents, dynamic RoPE)."""

from __future__ import annotations

import pytest
import torch

from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.checkpoint.convert import convert
from trtpipe.models.synthetic import make_synthetic
from trtpipe.runtime import load_checkpoint
from trtpipe.serving.api import SamplingParams, StepBatch, StepEntry
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.serving.tree_verify import (
    accepted_slot_moves,
    candidate_paths,
    greedy_accept,
    mask_from_parents,
    parents_from_mask,
    paths_from_parents,
    positions_from_parents,
    sampled_accept,
    verify_masked,
)

TPB = 4
BLOCKS = 8
# root 0 (the last token); 1, 2 its children; 3, 4 under 1; 5 under 2; 6 under 3; 7 under 5
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]
PATH = [2, 5, 7]  # the accepted path (depths 1, 2, 3: each moves to the position after the one before)


# ---- pure functions ------------------------------------------------------------------------------------------------


def test_mask_positions_and_paths_of_a_tree():
    m = mask_from_parents(PARENTS)
    assert m[7].nonzero().flatten().tolist() == [0, 2, 5, 7]
    assert m[4].nonzero().flatten().tolist() == [0, 1, 4]
    assert positions_from_parents(PARENTS) == [0, 1, 1, 2, 2, 2, 3, 3]
    assert parents_from_mask(m) == PARENTS
    assert paths_from_parents(PARENTS) == [[1, 4], [1, 3, 6], [2, 5, 7]]


def test_a_mask_that_is_not_a_tree_is_refused_and_needs_its_paths():
    m = mask_from_parents([-1, 0, 1])
    m[2, 0] = False  # node 2 sees its parent but not the root: lookahead-style, not a tree
    with pytest.raises(ValueError, match="row 2"):
        parents_from_mask(m)
    e = StepEntry(0, [5, 6, 7], 3, [0], False, True, spec_mask=m, spec_paths=[[1, 2]])
    assert candidate_paths(e) == [[1, 2]]
    with pytest.raises(ValueError, match="parent 2 is not an earlier node"):
        mask_from_parents([-1, 2, 0])


def test_greedy_accept_takes_the_longest_agreeing_path():
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    # the target's token at each node: root -> 12 (node 2), node 2 -> 15 (node 5), node 5 -> 17 (node 7), node 7 -> 99
    best = [12, 13, 15, 0, 0, 17, 0, 99]
    assert greedy_accept(tokens, paths_from_parents(PARENTS), best) == ([2, 5, 7], [12, 15, 17, 99])
    best[5] = 42  # node 7 rejected: accept 2, 5 then the target's 42
    assert greedy_accept(tokens, paths_from_parents(PARENTS), best) == ([2, 5], [12, 15, 42])
    best[0] = 11  # the other branch: node 1 then its child 3 (13) or 4 (14): the target says 14
    best[1] = 14
    assert greedy_accept(tokens, paths_from_parents(PARENTS), best) == ([1, 4], [11, 14, 0])
    assert greedy_accept(tokens, paths_from_parents(PARENTS), [7] * 8) == ([], [7])


def test_sampled_accept_follows_the_drawn_tokens():
    tokens = [10, 11, 12, 13, 14, 15, 16, 17]
    draws = {0: 12, 2: 15, 5: 3}
    seen = []

    def draw(node):
        seen.append(node)
        return draws[node]

    assert sampled_accept(tokens, paths_from_parents(PARENTS), draw) == ([2, 5], [12, 15, 3])
    assert seen == [0, 2, 5]  # one draw per visited node, in order


def test_sampled_masked_verification_keeps_the_target_distribution():
    """Root and one child per token: the emitted first token is the target's sample at the root whatever the drafts,
    and the second is drawn from the accepted child's row: compare the frequencies with the exact distribution."""
    V = 4
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    tokens, parents = [0, 1, 2], [-1, 0, 0]  # children hold tokens 1 and 2
    g = torch.Generator().manual_seed(0)
    e = StepEntry(
        0, tokens, 4, [0], False, True, SamplingParams(temperature=1.0), g, spec_mask=mask_from_parents(parents)
    )
    counts = torch.zeros(V, V)
    n = 4000
    for _ in range(n):
        _, out = verify_masked(e, logits)
        if len(out) == 2:
            counts[out[0], out[1]] += 1
        else:
            counts[out[0], V - 1] += 0  # a root token without a child: emitted alone
    p0 = torch.softmax(logits[0], -1)
    for tok, row in ((1, 1), (2, 2)):  # P(first = tok, second = j) = p0[tok] * p_row[j]
        want = p0[tok] * torch.softmax(logits[row], -1) * n
        got = counts[tok]
        chi2 = float(((got - want) ** 2 / want).sum())
        assert chi2 < 16.27, (tok, got.tolist(), want.tolist())  # chi-square, 3 dof, p = 0.001


def test_accepted_slot_moves():
    table = [5, 2, 7]
    # start_pos 3: node 2 (pos 5 -> slot 2*4+1) to pos 4 (slot 2*4+0); node 5 (pos 8: block 7) to pos 5; 7 to 6
    assert accepted_slot_moves(table, 3, [2, 5, 7], TPB) == ([9, 28, 30], [8, 9, 10])
    assert accepted_slot_moves(table, 3, [1, 2], TPB) == ([], [])  # a chain: already in place
    with pytest.raises(ValueError, match="grow"):
        accepted_slot_moves(table, 3, [2, 1], TPB)


# ---- the engine ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("tree"), {}

    def get(kind, **overrides):
        name = kind + "".join(f"_{k}" for k in overrides)
        if name not in made:
            hf = make_synthetic(kind, root / f"{name}_hf", seed=4, **overrides)
            made[name] = load_checkpoint(convert(hf, root / name, tp=1, dtype="float32"))
        return made[name]

    return get


def _engine(model, double=False):
    eng = ReferenceEngine(float64_copy(model) if double else model)
    eng.allocate(BLOCKS, TPB)
    if double:
        eng.pools = {k: (a.double(), b.double()) for k, (a, b) in eng.pools.items()}
    return eng


def _prefill(eng, prompt):
    table = list(range(BLOCKS))
    eng.logits(StepBatch(0, [StepEntry(0, prompt, 0, table, True, True)]))
    return table


def _kept_kv(eng, length):
    return {k: (a[:length].double(), b[:length].double()) for k, (a, b) in eng.pools.items()}


def check_tree_against_chain(model, vocab: int, prompt_len: int = 11, seed: int = 0):
    """Tree step + move vs the chain of the accepted path: logits of the path's rows, the kept KV, and the logits of
    the step after, each within the float32 error of the chain (measured against a float64 chain)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
    tokens = torch.randint(3, vocab, (len(PARENTS),), generator=g).tolist()
    chain = [tokens[0]] + [tokens[i] for i in PATH]
    nxt = int(torch.randint(3, vocab, (1,), generator=g))
    L = prompt_len
    tree, f32, f64 = _engine(model), _engine(model), _engine(model, double=True)
    for eng in (tree, f32, f64):
        table = _prefill(eng, prompt)
    got = tree.logits(
        StepBatch(
            1,
            [
                StepEntry(
                    0,
                    tokens,
                    L,
                    table,
                    False,
                    True,
                    spec_positions=positions_from_parents(PARENTS),
                    spec_mask=mask_from_parents(PARENTS),
                )
            ],
        )
    )
    assert got.shape[0] == len(PARENTS)
    want = [eng.logits(StepBatch(1, [StepEntry(0, chain, L, table, False, True)])) for eng in (f32, f64)]
    rows = [0, *PATH]
    scale = error_scale(want[0], want[1])
    assert_as_accurate(got[rows], want[1], scale, "tree rows of the accepted path vs the chain")
    src, dst = accepted_slot_moves(table, L, PATH, TPB)
    tree.move_slots(src, dst)
    n = L + len(chain)
    kv = [_kept_kv(eng, n) for eng in (tree, f32, f64)]
    for key in kv[0]:
        for j in range(2 if kv[0][key][1].numel() else 1):  # MLA caches latents only (no value pool)
            s = error_scale(kv[1][key][j], kv[2][key][j])
            assert_as_accurate(kv[0][key][j], kv[2][key][j], s, f"KV {key}[{j}] after the move vs the chain")
    after = [eng.logits(StepBatch(2, [StepEntry(0, [nxt], n, table, False, True)])) for eng in (tree, f32, f64)]
    assert_as_accurate(after[0], after[2], error_scale(after[1], after[2]), "the step after the move")


def test_tree_equals_chain_on_stories(model_tp1):
    check_tree_against_chain(model_tp1, model_tp1.args.vocab_size)


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama3", {}),  # grouped-query attention
        ("mistral", {}),  # sliding window 8: the prompt slides past it, the tree's positions decide the window
        ("gpt_oss", {}),  # attention sinks and alternating sliding layers
        ("gemma3", {}),  # local and global layers with their own ropes
        ("deepseek_v3", {}),  # MLA: the latents are what is cached and moved
        (
            "llama",
            {
                "max_position_embeddings": 16,
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),  # dynamic RoPE: no table, positions computed per entry
    ],
)
def test_tree_equals_chain_on_every_attention_kind(synthetic, kind, overrides):
    model = synthetic(kind, **overrides)
    check_tree_against_chain(model, model.args.vocab_size)
