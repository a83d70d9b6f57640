"""EAGLE-1/2 heads (the engine path's ``--speculative_decoding_mode eagle``): drafting from the target's features.

The head, as the EAGLE repository defines it (``eagle/model/cnets1.py@c9292914``, ``Model`` and
``LlamaDecoderLayer``): ``x = fc([emb(t[j + 1]); f[j]])`` (``fc`` a biased ``Linear(2H, H)``), then Llama decoder
layers over ``x`` whose layer 0 has no ``input_layernorm`` (``if self.index != 0``), and no final norm; the draft
logits are the *target's* lm_head over the output (``topK_genrate(hidden_states, input_ids, head=base_model.lm_head)``)
and the output is the feature the next draft reads. ``f`` is the target's output after its final norm:
``ea_model.py@2320d52e`` feeds ``base_model.model(...)`` ``outputs[0]`` (LlamaModel's normed output), the state the
target's lm_head reads. TensorRT-LLM's engine builds the same network (``EagleNet`` over a ``LLaMAModel`` with
``fc_after_embed``, ``use_input_layernorm_in_first_layer = False``, ``use_last_layernorm = False`` and its own copy
of the base lm_head; ``tensorrt_llm/models/eagle/model.py@89fd9b74``).

The twin drafts the chain of ``eagle_choices`` ``[[0], [0, 0], ...]`` (each draft the head's top-1 after the
previous one) with :class:`~trtpipe.serving.hidden_draft.HiddenDrafter`, the drafter EAGLE-3 and MTP use: the head
keeps its own paged KV, catches up on the target's features of the positions it has not read, then steps on its
own output; the drafts are verified by the one acceptance rule (:func:`trtpipe.serving.speculative.verify`). A
static tree (``eagle_choices`` with siblings) drafts level by level (:class:`Eagle1TreeDrafter`) and is verified
as a token set with the tree mask (:mod:`trtpipe.serving.tree_verify`).

A head is read from its published directory (``config.json`` and ``pytorch_model.bin`` or ``model.safetensors``:
``fc.*``, ``embed_tokens.weight``, ``layers.{l}.*``; a ``model.`` prefix is also read) or from the
``EagleForCausalLM`` TensorRT-LLM checkpoint the engine was built from (its ``eagle_nets.0.*``,
:mod:`trtpipe.checkpoint.eagle`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trtpipe.checkpoint.eagle import ARCHITECTURE, read_head, trt_layer_tensors
from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.runtime.linear import Float32Linear
from trtpipe.runtime.model import DecoderLayer, ModelArgs, ReferenceModel, rms_norm
from trtpipe.serving.hidden_draft import FINAL, HiddenDrafter, eagle3_args


def head_args(cfg: dict, vocab_size: int, where: str) -> ModelArgs:
    """The head's layer numbers from its (Llama) config.json; its logits are over the target's vocabulary."""
    n = int(cfg.get("num_hidden_layers") or 1)
    args = eagle3_args({**cfg, "vocab_size": vocab_size, "draft_vocab_size": vocab_size}, where)
    return dataclasses.replace(args, num_layers=n)


class Eagle1Head(nn.Module):
    """An EAGLE-1/2 head over the target's final-normed output, drafting with the target's lm_head."""

    def __init__(
        self,
        target: ReferenceModel,
        args: ModelArgs,
        layers: list[dict],
        fc: tuple,
        embedding,
        where: str,
        checkpoint_dir=None,
    ):
        """``checkpoint_dir``: the target's checkpoint, read for the lm_head's other tp shards when ``target`` is
        rank 0's shard under mpirun (:func:`~trtpipe.runtime.distributed.whole_lm_head`)."""
        from trtpipe.runtime.distributed import whole_lm_head

        super().__init__()
        H, V = target.args.hidden_size, target.args.vocab_size
        if args.hidden_size != H:
            raise CheckpointError(f"{where}: EAGLE head hidden_size {args.hidden_size} differs from the target's {H}")
        w, b = fc
        if tuple(w.shape) != (H, 2 * H):
            raise CheckpointError(
                f"{where}: EAGLE head fc.weight is {tuple(w.shape)}; [emb; feature] needs {(H, 2 * H)}"
            )
        if embedding.shape != (V, H):
            raise CheckpointError(
                f"{where}: EAGLE head embed_tokens is {tuple(embedding.shape)}; the target's vocabulary needs {(V, H)}"
            )
        self.capture, self.d2t, self.target, self.eps = (FINAL,), None, target, args.norm_epsilon
        self.lm_head = whole_lm_head(target, checkpoint_dir)
        self.tree: Optional[list[list[int]]] = None  # eagle_choices with siblings (None: the chain)
        self.fc = Float32Linear(w, b)
        ones = torch.ones(H)
        self.layers = [
            DecoderLayer(args, [{"input_layernorm.weight": ones, **{k: v.float() for k, v in t.items()}}], i)
            for i, t in enumerate(layers)
        ]
        self.model = ReferenceModel(
            {"max_position_embeddings": args.max_position_embeddings}, args, embedding.float(), self.layers, ones, []
        )

    depths, vanilla = 1, False  # its layers run as one head, reused for every draft

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, paged, cos_sin, depth: int = 0) -> torch.Tensor:
        """[1, N, H] embeddings and [1, N, H] features -> the head's output features [1, N, H]."""
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        first = self.layers[0]
        cos, sin = cos_sin["global"]
        x = x + first.attention[0](x, cos, sin, 0, paged, (0, 0))  # layer 0: no input_layernorm
        x = x + first.mlp[0](rms_norm(x, first.post_ln, self.eps))
        for layer in self.layers[1:]:
            x = layer(x, 0, paged, cos_sin)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        # the target's lm_head (its tp shards' columns side by side, as MTPHead reads it)
        return torch.cat([m(x) for m in self.lm_head], dim=-1)[..., : self.target.args.vocab_size].float()

    def next_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def drafter(self, target_engine, pool) -> HiddenDrafter:
        if self.tree is None:
            return HiddenDrafter(self, target_engine, pool)
        return Eagle1TreeDrafter(self, target_engine, pool)


def load_eagle1_head(path: str | Path, target: ReferenceModel, checkpoint_dir=None) -> Eagle1Head:
    """An EAGLE-1/2 head for ``target`` from a published head directory or an ``EagleForCausalLM`` checkpoint
    (``checkpoint_dir``: the target's, when it is rank 0's shard under mpirun: :class:`Eagle1Head`)."""
    d = Path(path)
    cfg = load_json(d / "config.json", CheckpointError) if (d / "config.json").is_file() else {}
    V = target.args.vocab_size
    if cfg.get("architecture") == ARCHITECTURE:
        from trtpipe.checkpoint.eagle import checkpoint_head

        layers, fc, emb, net = checkpoint_head(d)
        return Eagle1Head(target, head_args(net, V, str(d / "config.json")), layers, fc, emb, str(d), checkpoint_dir)
    t, cfg = read_head(d)
    where = str(d)
    for n in ("fc.weight", "fc.bias"):
        if n not in t:
            raise CheckpointError(f"{where}: EAGLE head tensor '{n}' is missing")
    if int(cfg.get("vocab_size") or V) != V:
        raise CheckpointError(f"{where}: EAGLE head vocab_size {cfg.get('vocab_size')} differs from the target's {V}")
    args = head_args(cfg, V, str(d / "config.json"))
    layers = [trt_layer_tensors(t, i, where) for i in range(args.num_layers)]
    emb = t.get("embed_tokens.weight", target.embedding)  # cnets1 loads the base model's embedding when absent
    return Eagle1Head(target, args, layers, (t["fc.weight"], t["fc.bias"]), emb, where, checkpoint_dir)


def parse_tree(text: str, k: int) -> Optional[list[list[int]]]:
    """The executor's ``eagle_choices`` (Triton's brace format) as paths in node order (by depth, then ranks), or
    None for the chain of ``k`` (what :class:`HiddenDrafter` drafts). Checked as upstream's ``check_eagle_choices``:
    every path's prefix is in the tree; ValueError in one line otherwise."""
    from trtpipe.serving.medusa import chain_choices, parse_choices

    if not text:
        return None
    tree = sorted({tuple(c) for c in parse_choices(text, "eagle_choices")}, key=lambda c: (len(c), c))
    paths = [list(c) for c in tree]
    loose = next((c for c in paths if len(c) > 1 and c[:-1] not in paths), None)
    if loose is not None:
        raise ValueError(f"eagle_choices {text!r}: choice {loose} is not connected (its prefix is missing)")
    if len(paths) != k:
        raise ValueError(f"eagle_choices {text!r}: {len(paths)} draft tokens, but max_draft_len is {k}")
    return None if paths == chain_choices(k) else paths


class Eagle1TreeDrafter(HiddenDrafter):
    """EAGLE-1's static tree (``eagle_choices`` with siblings), drafted as TensorRT-LLM's EagleNets do
    (``EagleForCausalLM._eagle_fwd_helper`` in ``tensorrt_llm/models/eagle/model.py@89fd9b74``): the head's
    catch-up forward gives the root's logits, whose top-k ranks are the depth-1 nodes; then, level by level, one
    forward over every non-leaf node up to that depth (each node reads its token and its parent's output feature, at
    its depth's position, seeing only its ancestors: a tree mask over the catch-up's KV, "Draft2 is called for inputs
    [FGIJ]" in upstream's docstring) gives each node's logits, whose ranks name its children. The drafts go to the
    target as a token set (:func:`trtpipe.serving.tree_verify.tree_fields`), verified with the tree mask; a request
    with room for fewer drafts takes the tree's first nodes in node order (still a tree).

    EAGLE-3's static tree drafts the same way with an :class:`~trtpipe.serving.hidden_draft.Eagle3Head`: TensorRT-LLM's
    two-model tree drafter gathers, per draft layer, every node with children and its ancestors
    (``SpecTreeManager.tokens_gather_idx``), at position offsets ``depth - 1`` past the root
    (``spec_dec_position_offsets_for_drafter_model``), each reading its parent's hidden state
    (``hidden_states_read_indices_offset_for_drafter_model``), and takes each node's children from the top-k of its
    logits (``top_k_list``; ``tensorrt_llm/_torch/speculative/spec_tree_manager.py@040bc9a2``). A head with a
    reduced draft vocabulary ranks its own logits and maps the ranked ids through ``d2t``."""

    def __init__(self, head: Eagle1Head, target_engine, pool):
        super().__init__(head, target_engine, pool)
        self.tree = head.tree
        self._root = None

    def _forward(self, entries, hidden, depth: int = 0):
        logits, nxt = super()._forward(entries, hidden, depth)
        if self._root is None:  # the catch-up forward of propose: the roots' logits and features
            self._root = (entries, logits, nxt)
        return logits, nxt

    def _catch_up(self, requests: list, ks: dict[int, int]) -> dict:
        """The head's catch-up forward alone (one draft's worth of :meth:`HiddenDrafter.propose`): per request id,
        (its root's logits, its root's output feature); requests not ready are absent."""
        self._root = None
        super().propose(requests, {r.id: min(1, ks[r.id]) for r in requests})
        if self._root is None:
            return {}
        entries, logits, feats = self._root
        self._root = None
        return {e.request_id: (logits[i], feats[i]) for i, e in enumerate(entries)}

    def _fits(self, r, nodes: int) -> bool:
        """The pool has the blocks of the head's KV of ``nodes`` tree nodes past the request's last token."""
        return self.pool.blocks_for(len(r.tokens) - 1 + nodes) - len(r.block_table) <= self.pool.num_free

    def _grow(self, r, nodes: int) -> None:
        """The head's KV of the nodes goes to the request's own blocks (its extra layers), rewritten next catch-up."""
        r.perf.kv_alloc_new_blocks += self.pool.grow(r.block_table, len(r.tokens) - 1 + nodes)

    def _forward_nodes(self, groups: list) -> list:
        """One head forward over tree nodes of several requests: per group ``(request, tokens, parents, positions,
        hidden)`` (``parents[i]`` the index of node i's parent in the group, -1 under the root; ``positions`` the
        offsets past the last token, depth - 1; ``hidden`` ``[len(tokens), H]``, each node's parent's feature), each
        node seeing the catch-up's KV and its ancestors in the group (a tree mask). Per group (logits, features)."""
        from trtpipe.serving.api import StepEntry
        from trtpipe.serving.tree_verify import mask_from_parents

        step = [
            StepEntry(
                r.id,
                list(tokens),
                len(r.tokens) - 1,
                r.block_table,
                False,
                True,
                spec_positions=list(positions),
                spec_mask=mask_from_parents([-1] + [x + 1 for x in parents])[1:, 1:],
            )
            for r, tokens, parents, positions, _ in groups
        ]
        logits, feats = self._forward(step, torch.cat([g[4] for g in groups]))
        out, row = [], 0
        for g in groups:
            out.append((logits[row : row + len(g[1])], feats[row : row + len(g[1])]))
            row += len(g[1])
        return out

    @torch.no_grad()
    def propose(self, requests: list, ks: dict[int, int]) -> dict:
        from trtpipe.serving.tree_verify import tree_fields

        roots = self._catch_up(requests, ks)
        if not roots:
            return {}
        by_id = {r.id: r for r in requests}
        work = []  # per request: (id, paths, parents, logits per node, features per node)
        for rid, (root_logits, root_feat) in roots.items():
            r, k = by_id[rid], ks[rid]
            while k > 1 and not self._fits(r, k):
                k -= 1  # the nodes' positions need blocks the pool does not have: the tree's first k nodes
            self._grow(r, k)
            paths = self.tree[:k]
            parents = [-1] + [0 if len(p) == 1 else paths.index(p[:-1]) + 1 for p in paths]
            work.append((rid, paths, parents, {0: root_logits}, {0: root_feat}))
        depth = max(len(p) for _, paths, *_ in work for p in paths)
        tokens = {rid: [None] * (len(paths) + 1) for rid, paths, *_ in work}
        for d in range(1, depth + 1):
            for rid, paths, parents, logits, _ in work:  # depth-d nodes: the ranks of their parents' logits
                for j, p in enumerate(paths, 1):
                    if len(p) == d:
                        tokens[rid][j] = self._map(int(logits[parents[j]].topk(p[-1] + 1).indices[p[-1]]))
            if d == depth:
                break
            groups, owners = [], []
            for rid, paths, parents, logits, feats in work:
                has_child = set(parents[1:])
                nodes = [j for j, p in enumerate(paths, 1) if len(p) <= d and j in has_child]
                if not any(len(paths[j - 1]) == d for j in nodes):
                    continue  # no node of this depth has children
                index = {j: i for i, j in enumerate(nodes)}  # the selected nodes' own tree (ancestors are selected)
                groups.append(
                    (
                        by_id[rid],
                        [tokens[rid][j] for j in nodes],
                        [index.get(parents[j], -1) for j in nodes],
                        [len(paths[j - 1]) - 1 for j in nodes],
                        torch.stack([feats[parents[j]] for j in nodes]),
                    )
                )
                owners.append((logits, feats, nodes))
            if not groups:
                break
            for (logits, feats, nodes), (out_logits, out_feats) in zip(owners, self._forward_nodes(groups)):
                for i, j in enumerate(nodes):
                    logits[j], feats[j] = out_logits[i], out_feats[i]
        return {rid: (tokens[rid][1:], None, tree_fields(parents)) for rid, _, parents, _, _ in work}
