"""Medusa heads: k extra heads over the target's last hidden state, each proposing the token one step further.

TensorRT-LLM's engine path (``trtllm-build --speculative_decoding_mode medusa``; ``MedusaLayer`` / ``MedusaHead`` /
``MedusaForCausalLm`` in ``tensorrt_llm/models/medusa/model.py@02499765``): head ``i`` is ``num_medusa_layers``
residual blocks ``x = x + silu(linear(x))`` and its own ``lm_head`` (no bias), applied to the hidden state the
target's lm_head reads (the base model's output after its final norm). At the position whose target logits gave the
last token ``t[n-1]``, head ``i`` proposes ``t[n+i]``: head 0 the token after the last one, head 1 the next.

The checkpoint is what upstream's converter reads (``load_medusa_hf``, ``tensorrt_llm/models/medusa/weight.py``): a
directory with ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and ``medusa_lm_head.pt`` or
``medusa_lm_head.safetensors`` holding ``{h}.{l}.linear.weight`` / ``.bias`` and ``{h}.{num_layers}.weight``
(FasterDecoding's ``medusa_lm_head`` state dict; a ``medusa_head.`` / ``medusa_heads.`` prefix is also read).

``medusa_choices`` is the tree of candidates (paths of top-k ranks per head, ``examples/medusa/README.md@27712aa7``;
its 63-node default is Medusa's ``mc_sim_7b_63``, and ``max_draft_len`` is the number of choices: 63 with
``num_medusa_heads=4`` in ``examples/llm-api/llm_medusa_decoding.py@a7b3f310``). Node ``c`` (choices sorted by length,
then by value, as Medusa's ``generate_medusa_buffers`` orders them) holds head ``len(c) - 1``'s rank-``c[-1]`` token;
its parent is ``c[:-1]`` (the last sampled token for a one-long path). The chain ``[[0], [0, 0], ..., [0] * k]`` is
verified like any other drafts (:func:`trtpipe.serving.speculative.verify`); a tree with siblings is verified in one
target forward with its tree mask and depths (:mod:`trtpipe.serving.tree_verify`): the longest path whose every
draft is the target's token at its parent, then the target's token after it, and the accepted drafts' KV moves
behind the prefix. Under sampling upstream's Medusa samples the target's token at every node (top-k) and accepts the
longest path of drafts equal to those samples (``MedusaDecodingLayer::samplePrimeHeadTokens`` /
``acceptDraftTokens`` -> ``acceptDraftTokensByIdsWithPaths``, ``cpp/tensorrt_llm/layers/medusaDecodingLayer.cpp@015884d6``;
typical acceptance is a TODO there): the twin does the same along the walk
(:func:`trtpipe.serving.tree_verify.sampled_accept`), so every emitted token is the target's sample. The chain's
deterministic drafts keep the one rejection-sampling rule against a one-hot draft, which is the same distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.runtime.linear import Float32Linear
from trtpipe.runtime.model import ReferenceModel
from trtpipe.recipe.medusa import tree_problem
from trtpipe.serving.hidden_draft import FINAL, HiddenDrafter, require_hidden_states


def chain_choices(k: int) -> list[list[int]]:
    """The chain of ``k`` top-1 candidates: ``[[0], [0, 0], ...]``."""
    return [[0] * (i + 1) for i in range(k)]


def is_chain(choices: list[list[int]]) -> bool:
    """Whether ``choices`` is a chain: one path of top-1 candidates, every prefix present."""
    return sorted(choices, key=len) == chain_choices(len(choices))


def sorted_choices(choices) -> list[list[int]]:
    """The choices in node order: by length, then by value (Medusa's ``generate_medusa_buffers``)."""
    return sorted(([int(i) for i in c] for c in choices), key=lambda c: (len(c), c))


def tree_parents(choices) -> list[int]:
    """Parents of the tree's nodes (node 0: the last sampled token, node i: ``choices[i - 1]``, choices sorted)."""
    index = {tuple(c): i + 1 for i, c in enumerate(choices)}
    return [-1] + [index[tuple(c[:-1])] if len(c) > 1 else 0 for c in choices]


def parse_choices(text: str, key: str = "medusa_choices") -> list[list[int]]:
    """Triton's ``medusa_choices`` / ``eagle_choices`` (``"{0}, {0, 0}"``, tensorrtllm_backend
    ``docs/model_config.md@7bc57da0``)."""
    import re

    body = text.strip()
    if not re.fullmatch(r"\{\s*\d+(\s*,\s*\d+)*\s*\}(\s*,\s*\{\s*\d+(\s*,\s*\d+)*\s*\})*", body):
        raise ValueError(f"tensorrt_llm twin: {key} {text!r} is not of the form '{{0}}, {{0, 0}}'")
    return [[int(i) for i in g.split(",")] for g in re.findall(r"\{([^}]*)\}", body)]


# Triton parameter -> (executor decoding type, what drafts): the heads whose choices the twin checks
CHOICES = {"medusa_choices": ("Medusa", "Medusa heads"), "eagle_choices": ("Eagle", "EAGLE head")}


def check_choices(text: str, config, key: str = "medusa_choices") -> list[list[int]]:
    """Triton ``medusa_choices`` / ``eagle_choices`` as the tree the twin drafts, or ValueError in one line: the model
    must speculate with those heads, the choices be a tree, their number ``max_draft_len`` (as trtllm-build requires),
    and ``eagle_choices`` the executor's own tree (the recipe's, carried in the twin's settings)."""
    kind, what = CHOICES[key]
    got = parse_choices(text, key)
    problem = tree_problem(got)
    if config.speculative_decoding_type != kind:
        problem = f"the model does not speculate with {kind} (speculative.decoding_type)"
    elif not problem and len(got) != config.max_draft_len:
        problem = f"{len(got)} choices; max_draft_len is {config.max_draft_len} (trtllm-build needs them equal)"
    elif not problem and key == "eagle_choices":
        want = parse_choices(config.eagle_choices, key) if config.eagle_choices else chain_choices(config.max_draft_len)
        if sorted(got) != sorted(want):
            problem = f"the twin executes {want} of its {what} (speculative.{key})"
    if problem:
        raise ValueError(f"tensorrt_llm twin: {key} {text!r}: {problem}")
    return got


class MedusaHeads(nn.Module):
    """Medusa heads over the target's hidden state after its final norm."""

    def __init__(self, target: ReferenceModel, tensors: dict, num_heads: int, num_layers: int, where: str):
        super().__init__()
        H, V = target.args.hidden_size, target.args.vocab_size
        self.capture, self.d2t, self.vocab = (FINAL,), None, V
        self.blocks: list[list[Float32Linear]] = []
        self.lm_heads: list[Float32Linear] = []
        for h in range(num_heads):
            layers = []
            for j in range(num_layers):
                name = f"{h}.{j}.linear"
                if f"{name}.weight" not in tensors:
                    raise CheckpointError(f"{where}: Medusa head {h}: tensor '{name}.weight' is missing")
                w = tensors[f"{name}.weight"]
                if tuple(w.shape) != (H, H):
                    raise CheckpointError(f"{where}: '{name}.weight' is {tuple(w.shape)}; the target's width is {H}")
                layers.append(Float32Linear(w, tensors.get(f"{name}.bias")))
            lm = tensors.get(f"{h}.{num_layers}.weight")
            if lm is None:
                raise CheckpointError(
                    f"{where}: Medusa head {h}: tensor '{h}.{num_layers}.weight' (lm_head) is missing"
                )
            if lm.shape[1] != H or lm.shape[0] < V:
                raise CheckpointError(
                    f"{where}: Medusa head {h}: lm_head is {tuple(lm.shape)}; the target needs [>= {V}, {H}]"
                )
            self.blocks.append(layers)
            self.lm_heads.append(Float32Linear(lm[:V]))
        self.num_heads = num_heads

    def logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """[R, H] hidden states -> [k, R, V] logits of heads 0..k-1."""
        out = []
        for h in range(k):
            x = hidden.float()
            for layer in self.blocks[h]:
                x = x + nn.functional.silu(layer(x))
            out.append(self.lm_heads[h](x))
        return torch.stack(out)

    def drafter(self, target_engine, pool) -> "MedusaDrafter":
        return MedusaDrafter(self, target_engine)

    choices: Optional[list[list[int]]] = None  # the tree to draft (sorted); None: the chain of top-1 candidates


def load_medusa_heads(head_dir: str | Path, target: ReferenceModel, num_heads: Optional[int] = None) -> MedusaHeads:
    """Medusa heads for ``target`` from a heads directory (config.json + medusa_lm_head.pt / .safetensors) or from a
    ``MedusaForCausalLM`` TensorRT-LLM checkpoint (what the engine was built from: its ``medusa_heads.*``);
    ``num_heads`` (the recipe's ``num_medusa_heads``) overrides the heads' ``medusa_num_heads``."""
    from trtpipe.checkpoint.medusa import ARCHITECTURE, checkpoint_heads, read_heads

    d = Path(head_dir)
    if (d / "config.json").is_file() and load_json(d / "config.json", CheckpointError).get(
        "architecture"
    ) == ARCHITECTURE:
        t, n, layers = checkpoint_heads(d)
        return MedusaHeads(target, {k: v.float() for k, v in t.items()}, n, layers, str(d))
    t, cfg = read_heads(d)
    n = num_heads or cfg.get("medusa_num_heads")
    layers = cfg.get("medusa_num_layers")
    if not n or layers is None:
        raise CheckpointError(f"{d / 'config.json'}: medusa_num_heads and medusa_num_layers are needed")
    return MedusaHeads(target, {k: v.float() for k, v in t.items()}, int(n), int(layers), str(d))


class MedusaDrafter(HiddenDrafter):
    """Drafts with Medusa heads from the target's hidden state at the position before the last token (the state the
    target's own lm_head read to emit it). Keeps per-request hidden states as :class:`HiddenDrafter` does; the
    heads have no KV cache."""

    def __init__(self, heads: MedusaHeads, target_engine):
        require_hidden_states(target_engine, "Medusa")
        self.head, self.target = heads, target_engine
        self.depths, self.vanilla = 1, False
        target_engine.capture = heads.capture
        self.state = {}
        self.vocab = target_engine.model.args.vocab_size

    def forget(self, request_id: int) -> None:
        self.state.pop(request_id, None)

    @torch.no_grad()
    def propose(self, requests: list, ks: dict[int, int]) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        """Up to ``num_heads`` top-1 drafts per request (the chain), all requests' heads in one batched pass; the
        drafts are deterministic, so no distributions come back."""
        live, rows = [], []
        for r in requests:
            st = self.state.get(r.id)
            pos = len(r.tokens) - 2
            if st is None or st.rows is None or not st.start <= pos < st.start + len(st.rows):
                continue  # a prompt prefix from the KV cache (reuse) was never computed: no hidden state
            live.append(r)
            rows.append(st.rows[pos - st.start])
            st.rows, st.start = st.rows[pos - st.start :], pos  # the next step's entry starts at pos + 1
        if not live:
            return {}
        if self.head.choices is not None:
            return self._tree(live, ks, torch.stack(rows))
        k = min(max(ks[r.id] for r in live), self.head.num_heads)
        best = self.head.logits(torch.stack(rows), k).argmax(-1)  # [k, R]
        return {r.id: (best[: min(ks[r.id], k), i].tolist(), None) for i, r in enumerate(live)}

    def _tree(self, live: list, ks: dict[int, int], rows: torch.Tensor) -> dict:
        """The tree's tokens per request (head ``len(c) - 1``'s rank ``c[-1]`` at node ``c``) with its mask and
        depths; a request with room for fewer drafts than nodes takes the first ``ks`` nodes (node order keeps every
        parent before its children)."""
        from trtpipe.serving.tree_verify import tree_fields

        choices = self.head.choices
        depth = max(len(c) for c in choices)
        logits = self.head.logits(rows, depth)  # [depth, R, V]
        top = [logits[h].topk(1 + max(c[-1] for c in choices if len(c) == h + 1), dim=-1).indices for h in range(depth)]
        parents = tree_parents(choices)
        out = {}
        for i, r in enumerate(live):
            m = min(ks[r.id], len(choices))
            out[r.id] = ([int(top[len(c) - 1][i, c[-1]]) for c in choices[:m]], None, tree_fields(parents[: m + 1]))
        return out
