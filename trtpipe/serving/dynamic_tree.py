"""EAGLE-3's dynamic tree (EAGLE-2: ``use_dynamic_tree`` with ``dynamic_tree_max_topK``), drafted as TensorRT-LLM's
one-model worker drafts it (``Eagle3OneModelDynamicTreeWorker``, ``tensorrt_llm/_torch/speculative/
eagle3_dynamic_tree.py@470bb720``, picked by ``get_spec_worker`` in ``tensorrt_llm/_torch/speculative/utils.py`` for
the one-model EAGLE-3 with a dynamic tree).

The rule, with K = ``dynamic_tree_max_topK``, D = ``max_draft_len`` (the tree's depth) and T =
``max_total_draft_tokens``:

- layer 0: the root's (the catch-up's) softmax, its top K tokens the depth-1 nodes, each scored by its probability
  (``sample``: softmax then top-k, ids mapped through ``d2t``); all K are expanded;
- layers 1 .. D - 1: one head forward over every node expanded so far (the growing context: each reads its token
  and its parent's feature at position depth - 1, seeing its ancestors), whose last K rows (the nodes expanded last)
  give each of them K children scored by the product of their probability and the parent's score; the K * K
  children all enter the history, and the K best of them by score are the next layer's expanded nodes
  (``_select_topk_draft_tokens``);
- the tree is the T best history nodes by score, in history order (``_resample_final_tokens``), verified by the
  target in one forward with the tree mask (:mod:`trtpipe.serving.tree_verify`).

A node's score never exceeds its parent's, so the T best hold every selected node's parent except where scores
tie; a node whose parent was not selected is dropped (the tree stays a tree). The twin reuses
:class:`~trtpipe.serving.eagle1.Eagle1TreeDrafter`'s catch-up and node forwards.

Upstream verifies the dynamic tree greedily only (``_sample_and_accept_dynamic_tree`` takes the target's argmax,
whatever the request's sampling), so a sampled request gets no dynamic tree in the twin: it decodes without drafts,
its distribution the target's, rather than being silently made greedy.
"""

from __future__ import annotations

import torch

from trtpipe.serving.eagle1 import Eagle1TreeDrafter


def select(scores: list[float], parents: list[int], total: int) -> list[int]:
    """The history nodes of the tree: the ``total`` best by score (``torch.topk``: ties in its order), in history
    order, less any whose parent (``parents[i]``, -1 the root) is not selected."""
    best = sorted(torch.topk(torch.tensor(scores, dtype=torch.float64), min(total, len(scores))).indices.tolist())
    kept: set[int] = set()
    for i in best:
        if parents[i] < 0 or parents[i] in kept:
            kept.add(i)
    return [i for i in best if i in kept]


class Eagle3DynamicTreeDrafter(Eagle1TreeDrafter):
    """The dynamic tree over an EAGLE-3 head (``head.dynamic``: (K, depth))."""

    def __init__(self, head, target_engine, pool):
        super().__init__(head, target_engine, pool)
        self.top_k, self.depth = head.dynamic

    def _expand(self, rid: int, path: tuple, row: torch.Tensor) -> tuple[list[int], list[float]]:
        """The K children of the node reached by ``path`` (target ids from the root) from its logits ``row``: their
        ids (mapped through ``d2t``) and probabilities."""
        p = torch.softmax(row.float(), dim=-1)
        v, i = torch.topk(p, min(self.top_k, p.numel()))
        return [self._map(int(x)) for x in i], v.tolist()

    @torch.no_grad()
    def propose(self, requests: list, ks: dict[int, int]) -> dict:
        from trtpipe.serving.tree_verify import tree_fields

        greedy = [r for r in requests if r.request.sampling.greedy]
        roots = self._catch_up(greedy, ks)
        K, by_id, work = self.top_k, {r.id: r for r in greedy}, []
        for rid, (root_logits, root_feat) in roots.items():
            r, total = by_id[rid], ks[rid]
            forwarded = K * (self.depth - 1)  # nodes the last layer's forward holds
            if not self._fits(r, max(total, forwarded)):
                continue  # no blocks for the nodes' head KV: no drafts this step
            self._grow(r, max(total, forwarded))
            ids, probs = self._expand(rid, (), root_logits)
            # history: token, parent (history index, -1 the root), score, path; expanded: history indices
            hist = [(t, -1, p, (t,)) for t, p in zip(ids, probs)]
            work.append({"r": r, "total": total, "hist": hist, "exp": list(range(len(hist))), "feat": {}})
            work[-1]["feat"].update({i: root_feat for i in work[-1]["exp"]})  # depth-1 nodes read the root's feature
        for _ in range(1, self.depth):
            live = [w for w in work if w["exp"]]
            if not live:
                break
            groups = []
            for w in live:  # every expanded node so far, each seeing its expanded ancestors
                exp = w["exp"]
                at = {h: i for i, h in enumerate(exp)}
                groups.append(
                    (
                        w["r"],
                        [w["hist"][h][0] for h in exp],
                        [at.get(w["hist"][h][1], -1) for h in exp],
                        [len(w["hist"][h][3]) - 1 for h in exp],
                        torch.stack([w["feat"][h] for h in exp]),
                    )
                )
            for w, (logits, feats) in zip(live, self._forward_nodes(groups)):
                frontier = w["exp"][-K:]  # the nodes expanded last (layer 0: all K)
                base = len(w["exp"]) - len(frontier)
                children = []
                for i, h in enumerate(frontier):
                    ids, probs = self._expand(w["r"].id, w["hist"][h][3], logits[base + i])
                    score = w["hist"][h][2]
                    children += [(t, h, score * p, w["hist"][h][3] + (t,), feats[base + i]) for t, p in zip(ids, probs)]
                top = torch.topk(torch.tensor([c[2] for c in children]), min(K, len(children))).indices.tolist()
                first = len(w["hist"])
                w["hist"] += [c[:4] for c in children]
                for j in top:
                    w["feat"][first + j] = children[j][4]
                    w["exp"].append(first + j)
        out = {}
        for w in work:
            hist = w["hist"]
            chosen = select([h[2] for h in hist], [h[1] for h in hist], w["total"])
            node = {h: j for j, h in enumerate(chosen, 1)}
            parents = [-1] + [0 if hist[h][1] < 0 else node[hist[h][1]] for h in chosen]
            out[w["r"].id] = ([hist[h][0] for h in chosen], None, tree_fields(parents))
        return out
