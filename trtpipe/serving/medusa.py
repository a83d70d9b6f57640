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

``medusa_choices`` is the tree of candidates (paths of top-k ranks per head, ``examples/medusa/README.md@27712aa7``).
The twin executes chain-shaped choices, ``[[0], [0, 0], ..., [0] * k]``: each head's top-1 after the previous one,
verified in one target forward like any other drafts (:func:`trtpipe.serving.speculative.verify`, the one acceptance
rule). A tree with siblings needs a tree attention mask in the verification forward, which the twin does not have:
the recipe refuses it (:mod:`trtpipe.recipe.speculative`). Under sampling the chain's drafts are deterministic
(top-1), so verification is rejection sampling against a one-hot draft: a draft is kept with the target's
probability of it, which is what matching the target's sampled token gives (upstream's Medusa README: only tokens
are matched, ``medusa_temperature=0``).
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
from trtpipe.serving.hidden_draft import FINAL, HiddenDrafter, require_hidden_states


def chain_choices(k: int) -> list[list[int]]:
    """The chain of ``k`` top-1 candidates: ``[[0], [0, 0], ...]``."""
    return [[0] * (i + 1) for i in range(k)]


def is_chain(choices: list[list[int]]) -> bool:
    """Whether ``choices`` is a chain: one path of top-1 candidates, every prefix present."""
    return sorted(choices, key=len) == chain_choices(len(choices))


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


def check_choices(text: str, config, key: str = "medusa_choices") -> None:
    """Refuse, in one line, Triton ``medusa_choices`` / ``eagle_choices`` other than what the twin drafts: the chain
    of ``max_draft_len``, or the executor's own ``eagle_choices`` tree."""
    kind, what = CHOICES[key]
    got = parse_choices(text, key)
    want = chain_choices(config.max_draft_len)
    if key == "eagle_choices" and config.eagle_choices:  # an EAGLE tree the executor drafts (trtpipe.serving.eagle1)
        want = parse_choices(config.eagle_choices, key)
    if config.speculative_decoding_type != kind or sorted(got) != sorted(want):
        raise ValueError(
            f"tensorrt_llm twin: {key} {text!r}: the twin executes {want} of its {what} (speculative.{key})"
        )


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

    def drafter(self, target_engine, num_blocks: int, tokens_per_block: int) -> "MedusaDrafter":
        return MedusaDrafter(self, target_engine)


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
        k = min(max(ks[r.id] for r in live), self.head.num_heads)
        best = self.head.logits(torch.stack(rows), k).argmax(-1)  # [k, R]
        return {r.id: (best[: min(ks[r.id], k), i].tolist(), None) for i, r in enumerate(live)}
