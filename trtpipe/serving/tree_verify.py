"""Tree (or any explicitly masked) verification of drafts: pure functions.

A generation :class:`~trtpipe.serving.api.StepEntry` may carry its ``n`` new tokens (the last sampled token, then the
drafts) as a token set rather than a chain: ``spec_positions`` (each token's position offset from ``start_pos``, its
RoPE position) and ``spec_mask`` (``[n, n]`` bool: token ``i`` attends to new token ``j``; every cached position before
``start_pos`` is visible to all of them, within a sliding window measured in positions). Medusa and EAGLE trees give
each node its depth and its ancestors (:func:`mask_from_parents`); lookahead decoding's mask is not a tree, so the
mask is the base form and the candidate paths acceptance walks are given apart (``spec_paths``; for a tree mask they
follow from it: :func:`parents_from_mask`, :func:`paths_from_parents`).

The engine writes the ``n`` tokens' KV at slots ``start_pos..start_pos + n - 1`` (token order, not depth order) and
returns one row of logits per token. Acceptance keeps the longest candidate path whose every token is the target's
token at its parent (:func:`greedy_accept`; under sampling :func:`sampled_accept` draws the target's token at each
visited node and follows the child that drew it, so every emitted token is distributed as the target's). Then only
the accepted tokens' KV stays: the accepted drafts' KV moves to the positions right after the last token
(:func:`accepted_slot_moves`), as TensorRT-LLM's ``updateKVBlockArrayDraftTokenLocation`` does after Medusa/EAGLE
acceptance (``packedAcceptedDraftTokensIndices`` moved behind ``pastKeyValueLengths``;
``cpp/tensorrt_llm/kernels/speculativeDecoding/kvCacheUpdateKernels.h@20709ce9``). Positions past the accepted
length are stale and never read (the next step overwrites them).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from trtpipe.runtime.generate import sample


def mask_from_parents(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool: each node sees itself and its ancestors. ``parents[0]`` is -1 (the root: the last sampled
    token); ``parents[i] < i`` for every other node."""
    n = len(parents)
    _check_parents(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i:
            mask[i] |= mask[parents[i]]
    return mask


def positions_from_parents(parents: Sequence[int]) -> list[int]:
    """Each node's depth (its position offset from the root)."""
    _check_parents(parents)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_fields(parents: Sequence[int]) -> dict:
    """The :class:`~trtpipe.serving.api.StepEntry` fields of a tree (``spec_positions``, ``spec_mask``); a drafter
    returns them as the third item of a request's proposal, ``(drafts, probs, fields)``, the drafts in node order
    (node ``i`` is ``drafts[i - 1]``)."""
    return {"spec_positions": positions_from_parents(parents), "spec_mask": mask_from_parents(parents)}


def _check_parents(parents: Sequence[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError(f"tree parents {list(parents)}: node 0 (the last token) is the root, its parent -1")
    for i, p in enumerate(parents[1:], 1):
        if not 0 <= p < i:
            raise ValueError(f"tree parents {list(parents)}: node {i}'s parent {p} is not an earlier node")


def as_mask(mask: Any, n: int) -> torch.Tensor:
    """``spec_mask`` (a bool tensor or nested lists) as a ``[n, n]`` bool tensor with a true diagonal."""
    m = torch.as_tensor(mask, dtype=torch.bool)
    if tuple(m.shape) != (n, n):
        raise ValueError(f"spec_mask is {tuple(m.shape)}; the entry has {n} tokens")
    if not bool(m.diagonal().all()):
        raise ValueError("spec_mask: every token must see itself (a true diagonal)")
    return m


def parents_from_mask(mask: Any) -> list[int]:
    """The tree a mask describes (each node sees exactly itself and its ancestors), or ValueError when it is not one."""
    m = as_mask(mask, len(mask))
    parents = [-1]
    for i in range(1, m.shape[0]):
        seen = [j for j in range(i) if m[i, j]]
        if m[i, i + 1 :].any() or not seen or seen[0] != 0:
            raise ValueError(f"spec_mask row {i} is not a tree node's (it must see the root and no later token)")
        p = max(seen, key=lambda j: int(m[j].sum()))
        want = m[p].clone()
        want[i] = True
        if not torch.equal(m[i], want):
            raise ValueError(f"spec_mask row {i} is not its parent {p}'s row plus itself")
        parents.append(p)
    return parents


def paths_from_parents(parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf paths (node indices, the root left out), in node order of their leaves."""
    _check_parents(parents)
    has_child = {p for p in parents[1:]}
    paths = []
    for leaf in range(1, len(parents)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node > 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def candidate_paths(entry) -> list[list[int]]:
    """The paths acceptance considers for a masked entry: its ``spec_paths``, else the tree its mask describes."""
    if entry.spec_paths is not None:
        return [list(p) for p in entry.spec_paths]
    return paths_from_parents(parents_from_mask(entry.spec_mask))


def greedy_accept(
    tokens: Sequence[int], paths: Sequence[Sequence[int]], best: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The longest accepted path (first of equals) and what it emits.

    Args:
        tokens: the entry's tokens (index 0: the last sampled token).
        paths: candidate paths, each a list of indices into ``tokens`` (root left out, parents before children).
        best: the target's token at each index (argmax of its row).

    Returns:
        (accepted indices, emitted tokens: the accepted drafts, then the target's token after the last of them).
    """
    accepted: list[int] = []
    for path in paths:
        prev, n = 0, 0
        for node in path:
            if tokens[node] != best[prev]:
                break
            prev, n = node, n + 1
        if n > len(accepted):
            accepted = list(path[:n])
    last = accepted[-1] if accepted else 0
    return accepted, [tokens[i] for i in accepted] + [int(best[last])]


def sampled_accept(
    tokens: Sequence[int], paths: Sequence[Sequence[int]], draw: Callable[[int], int]
) -> tuple[list[int], list[int]]:
    """Token-matching acceptance under sampling: from the root, ``draw(node)`` samples the target's token at that
    node's row; the walk follows the candidate child holding that token, else emits it and stops. Each emitted token
    is the target's sample given the accepted ones, so the output is distributed as decoding without drafts."""
    accepted: list[int] = []
    node = 0
    while True:
        tok = int(draw(node))
        depth = len(accepted)
        child = next(
            (p[depth] for p in paths if len(p) > depth and list(p[:depth]) == accepted and tokens[p[depth]] == tok),
            None,
        )
        if child is None:
            return accepted, [tokens[i] for i in accepted] + [tok]
        accepted.append(child)
        node = child


def verify_masked(entry, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(accepted draft indices, emitted tokens) of a masked entry from its ``[n, V]`` logits: greedy
    (:func:`greedy_accept`) or sampled with the request's settings and generator (:func:`sampled_accept`)."""
    paths = candidate_paths(entry)
    s = entry.sampling
    if s.greedy:
        return greedy_accept(entry.tokens, paths, logits.argmax(-1).tolist())
    return sampled_accept(
        entry.tokens, paths, lambda node: sample(logits[node], s.temperature, s.top_k, s.top_p, entry.generator)
    )


def accepted_slot_moves(
    block_table: Sequence[int], start_pos: int, accepted: Sequence[int], tokens_per_block: int
) -> tuple[list[int], list[int]]:
    """(source slots, destination slots): accepted draft ``accepted[i]`` (an index into the entry's tokens, written
    at position ``start_pos + accepted[i]``) moves to position ``start_pos + 1 + i``; indices already in place are
    left out. Sources are never before their destinations (indices grow along a path), and a gather before the
    scatter (:func:`move_slots`) keeps overlapping moves right."""
    src, dst = [], []
    for i, idx in enumerate(accepted):
        if idx < i + 1:
            raise ValueError(f"accepted indices {list(accepted)} must grow along the path (index {idx} at {i})")
        if idx != i + 1:
            for pos, out in ((start_pos + idx, src), (start_pos + 1 + i, dst)):
                out.append(block_table[pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block)
    return src, dst


def move_slots(pools: dict, src: Sequence[int], dst: Sequence[int]) -> None:
    """Every pool tensor's rows ``src`` copied to ``dst`` (gathered first, then scattered)."""
    if not src:
        return
    for tensors in pools.values():
        for t in tensors:
            s = torch.tensor(list(src), device=t.device)
            d = torch.tensor(list(dst), device=t.device)
            t[d] = t[s].clone()


def kept_rows(rows: torch.Tensor, accepted: Sequence[int]) -> torch.Tensor:
    """Per-token rows of a masked entry (e.g. its captured hidden states, ``[n, ...]``) in the order the KV keeps
    them: the root's, then the accepted drafts'."""
    return rows[torch.tensor([0, *accepted], dtype=torch.long, device=rows.device)]


def spec_rope_positions(entry) -> Optional[list[int]]:
    """The entry's token positions when it carries ``spec_positions`` (None: start_pos.. in order)."""
    if entry.spec_positions is None:
        return None
    if len(entry.spec_positions) != len(entry.tokens) or entry.spec_positions[0] != 0:
        raise ValueError(
            f"request {entry.request_id}: spec_positions {list(entry.spec_positions)} must give each of its "
            f"{len(entry.tokens)} tokens an offset, the first 0"
        )
    return [entry.start_pos + int(p) for p in entry.spec_positions]
