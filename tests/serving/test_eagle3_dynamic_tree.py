"""EAGLE-3's dynamic tree (EAGLE-2; trtpipe/serving/dynamic_tree.py ``Eagle3DynamicTreeDrafter``, upstream's
``Eagle3OneModelDynamicTreeWorker``) in the executor, over the head trained in tests/serving/test_eagle3_tree.py.

Oracles: every expanded node's draft logits against the head's formula along the node's path in float64
(``path_logits``), tolerance from the same evaluation's float32 error; the selected tree against a float64
re-selection by the same rule (K children per expanded node by probability, scores multiplied along the path, the
K best per layer expanded, the T best overall kept), ties aside; greedy output equal to the output without
speculation and to transformers' float64 greedy; the counters equal a replay of each recorded tree's longest
matching path. Upstream verifies the dynamic tree greedily only, so a sampled request gets no dynamic tree.
"""

from __future__ import annotations

import json

import pytest
import torch

from numerics import assert_as_accurate, error_scale
from serving_oracle import check_greedy
from test_eagle3_tree import EOS, _replayed_tree_acceptance, path_logits, trained  # noqa: F401 (the fixture)
from test_hidden_draft import _config, _prompts, _serve
from trtpipe.serving.dynamic_tree import Eagle3DynamicTreeDrafter, select
from trtpipe.serving.reference_engine import draft_engine
from trtpipe.serving.tree_verify import parents_from_mask

K, DEPTH, TOTAL = 3, 3, 8


def test_selection_keeps_the_best_nodes_in_history_order_and_drops_orphans():
    scores = [0.5, 0.3, 0.2, 0.25, 0.1, 0.3]
    parents = [-1, -1, -1, 0, 0, 1]
    assert select(scores, parents, 4) == [0, 1, 3, 5]
    assert select([0.4, 0.2, 0.3], [-1, 5, -1], 3) == [0, 2]  # a node whose parent is absent is dropped


def _spy(monkeypatch) -> list:
    """Every proposal: (request id, its length, drafts, parents, [(path, logits row) of each node it expanded])."""
    proposals, expansions = [], []
    propose, expand = Eagle3DynamicTreeDrafter.propose, Eagle3DynamicTreeDrafter._expand

    def spy_propose(self, requests, ks):
        expansions.clear()
        out = propose(self, requests, ks)
        for r in requests:
            if r.id in out:
                drafts, _, fields = out[r.id]
                rows = [(path, row) for rid, path, row in expansions if rid == r.id]
                proposals.append((r.id, len(r.tokens), drafts, parents_from_mask(fields["spec_mask"]), rows))
        return out

    def spy_expand(self, rid, path, row):
        expansions.append((rid, path, row.clone()))
        return expand(self, rid, path, row)

    monkeypatch.setattr(Eagle3DynamicTreeDrafter, "propose", spy_propose)
    monkeypatch.setattr(Eagle3DynamicTreeDrafter, "_expand", spy_expand)
    return proposals


def reselect(logits_of, d2t, k: int, depth: int, total: int) -> tuple[list[int], list[int]]:
    """The EAGLE-2 rule in float64 over ``logits_of(path)`` (the head's logits after a path of target ids):
    (tokens, parents) in node order, parents as tree_verify's (0 the root)."""
    hist = []  # (token, parent history index, score, path)

    def children(path, score, parent):
        p = torch.softmax(logits_of(path), -1)
        v, i = p.topk(k)
        return [(int(x + d2t[x]), parent, score * float(q), path + (int(x + d2t[x]),)) for x, q in zip(i, v)]

    hist += children((), 1.0, -1)
    frontier = list(range(len(hist)))
    for _ in range(1, depth):
        first = len(hist)
        kids = [c for h in frontier for c in children(hist[h][3], hist[h][2], h)]
        hist += kids
        frontier = [first + j for j in torch.tensor([c[2] for c in kids]).topk(k).indices.tolist()]
    chosen = select([h[2] for h in hist], [h[1] for h in hist], total)
    node = {h: j for j, h in enumerate(chosen, 1)}
    return [hist[h][0] for h in chosen], [-1] + [0 if hist[h][1] < 0 else node[hist[h][1]] for h in chosen]


@pytest.mark.slow
def test_a_dynamic_tree_drafts_as_float64_keeps_greedy_output_and_counts_its_longest_path(trained, monkeypatch):  # noqa: F811
    d, head, model, hf32, hf64, t = trained
    cfg_head = json.loads((head / "config.json").read_text())
    prompts = _prompts(4, seed=11)
    n_out = 24
    plain, _ = _serve(model, _config(), prompts, n=n_out)
    proposals = _spy(monkeypatch)
    cfg = _config(
        speculative_decoding_type="Eagle3",
        max_draft_len=TOTAL,
        speculative_model=str(head),
        dynamic_tree_max_top_k=K,
        dynamic_tree_depth=DEPTH,
    )
    drafter = draft_engine(cfg, model, d)
    assert drafter.tree_drafter is Eagle3DynamicTreeDrafter
    spec, core = _serve(model, cfg, prompts, drafter, n=n_out)
    full = {}
    for rid, (p, a, b) in enumerate(zip(prompts, plain, spec), start=1):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # the dynamic tree changes nothing in greedy output
        assert check_greedy(model, hf64, p, b.tokens, n_out, EOS) == ""  # and it is transformers' float64 greedy
        full[rid] = p + b.tokens
    d2t = t["d2t"].long()
    # each expanded node's logits (the root's and every node expanded after it) against float64 along its path
    checked = 0
    for rid, n, drafts, parents, rows in proposals[:3]:
        seq = full[rid][:n]
        cache: dict = {}

        def logits_of(path, hf=hf64):
            key = (id(hf), path)
            if key not in cache:
                cache[key] = path_logits(hf, t, cfg_head, seq, list(path))[-1]
            return cache[key]

        assert len(rows) == 1 + K * (DEPTH - 1)  # the root, then K nodes per later layer
        for path, row in rows:
            r64, r32 = logits_of(path), logits_of(path, hf32)
            assert_as_accurate(row, r64, error_scale(r32, r64), f"request {rid}: node {list(path)} after {n}")
            checked += 1
        tokens, tree = reselect(logits_of, d2t, K, DEPTH, TOTAL)
        assert (drafts, parents) == (tokens, tree), f"request {rid} after {n}: the float64 re-selection differs"
    assert checked == 3 * (1 + K * (DEPTH - 1))
    drafted, accepted = _replayed_tree_acceptance([p[:4] for p in proposals], full)
    for rid, r in enumerate(spec, start=1):
        assert (r.perf.total_draft_tokens, r.perf.total_accepted_draft_tokens) == (drafted[rid], accepted[rid])
    s = core.speculator
    assert s.total_draft_tokens == sum(drafted.values()) > 0
    assert s.total_accepted_draft_tokens == sum(accepted.values()) > 0
    assert core.pool.stats().free_blocks == core.pool.stats().max_blocks
    assert s.draft.pool.num_free == s.draft.pool.num_blocks and not s.draft.state
    print(
        f"trained EAGLE-3 head, dynamic tree K {K} depth {DEPTH} T {TOTAL}: {s.total_accepted_draft_tokens} of "
        f"{s.total_draft_tokens} accepted"
    )


@pytest.mark.slow
def test_a_sampled_request_gets_no_dynamic_tree_as_upstream_verifies_it_greedily(trained):  # noqa: F811
    """Upstream's ``_sample_and_accept_dynamic_tree`` takes the target's argmax whatever the request's sampling: the
    twin drafts no dynamic tree for a sampled request (it decodes without drafts, so its distribution is the
    target's), and drafts one for a greedy request beside it."""
    from trtpipe.serving.api import Request, SamplingParams
    from trtpipe.serving.executor import ExecutorCore
    from trtpipe.serving.reference_engine import ReferenceEngine

    d, head, model, *_ = trained
    cfg = _config(
        speculative_decoding_type="Eagle3",
        max_draft_len=TOTAL,
        speculative_model=str(head),
        dynamic_tree_max_top_k=K,
        dynamic_tree_depth=DEPTH,
    )
    final = {}
    core = ExecutorCore(
        cfg,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=draft_engine(cfg, model, d),
    )
    prompt = [1, 403, 407, 261, 378]
    sampled = core.submit(
        Request(
            prompt,
            12,
            exclude_input_from_output=True,
            return_perf_metrics=True,
            sampling=SamplingParams(1.0, 20, 1.0, seed=3),
        )
    )
    greedy = core.submit(Request(prompt, 12, exclude_input_from_output=True, return_perf_metrics=True))
    core.run_until_idle()
    assert not final[sampled].has_error and len(final[sampled].tokens) == 12
    assert final[sampled].perf.total_draft_tokens == 0
    assert final[greedy].perf.total_draft_tokens > 0
