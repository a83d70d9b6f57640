"""Drafting from the target's hidden states: DeepSeek-V3's multi-token-prediction (MTP) layer and EAGLE-3 heads.

Both draft the token after position ``j`` from the pair (``t[j + 1]``, ``h[j]``): the next token's embedding and the
target's hidden state at ``j`` (TensorRT-LLM's ``MTPWorker`` docstring traces it: prompt ABCD, the draft layer reads
tokens BCDE against the target's H_A..H_D; ``tensorrt_llm/_torch/speculative/mtp.py@000a01de``). Later drafts feed
the head its own output hidden state with the token it just drafted, one position further.

- **MTP** (``decoding_type: MTP``; ``DeepseekV3MTP.forward`` in
  ``tensorrt_llm/_torch/models/modeling_deepseekv3.py@a43cf9e3``):
  ``x = eh_proj([enorm(emb(t)); hnorm(h)])``, one DeepSeek-V3 decoder block (MLA + MoE) over ``x``, then
  ``out = shared_head.norm(x)``; the logits are the target's lm_head over ``out`` and ``out`` is the hidden state the
  next draft reads. ``h`` is the target's output after its final norm (the last decoder layer's
  ``next_layer_layernorm`` is ``model.norm``, same file); the embedding is the target's (``embed_tokens`` is passed
  in). Which layers draft is TensorRT-LLM's ``MTPDecodingConfig.spec_dec_mode``
  (``tensorrt_llm/llmapi/llm_args.py@00043967``; ``mtp_eagle_one_model: false`` is ignored there): a checkpoint with
  ``num_nextn_predict_layers: 1`` (DeepSeek-V3's) reuses its one layer for every draft (MTP-Eagle,
  ``ckpt_nextn == 1 and not use_mtp_vanilla``, same file); more layers run vanilla MTP, layer d drafting the
  (d + 1)-th token over the stream shifted by d (``MTPWorker.forward``, mtp.py@000a01de), at most one draft per layer
  (``update_spec_config_from_model_config`` cuts max_draft_len to the layer count,
  ``tensorrt_llm/_torch/speculative/utils.py@011d0933``; trtpipe refuses a larger one in one line).
- **EAGLE-3** (``decoding_type: Eagle3``; ``Eagle3DraftModel`` / ``Eagle3DecoderLayer`` / ``Eagle3ForCausalLM`` in
  ``tensorrt_llm/_torch/models/modeling_speculative.py@00679c66``): the target's hidden states after layers
  ``(1, L // 2 - 1, L - 4)`` (``_get_eagle3_default_capture_layers``, ``tensorrt_llm/_torch/speculative/eagle3.py
  @f933a608``; each capture is the layer's output, ``hidden_states + residual``) are concatenated and ``fc`` maps
  them to the head's width ``g`` (only when the width is not already the head's: ``apply_eagle3_fc``). The layer:
  ``a = attn([input_layernorm(emb(t)); hidden_norm(g)])`` (qkv over 2 x hidden), ``x = g + a``,
  ``x = x + mlp(post_attention_layernorm(x))``; logits ``lm_head(norm(x))`` over the head's ``draft_vocab_size``,
  mapped to the target's ids by ``t = d + d2t[d]``; the next draft reads ``x`` (the pre-norm sum,
  ``hidden_states_to_save``). The embedding is the target's unless the head stores its own; the lm_head is the
  head's unless it has none (``load_lm_head_from_target``).

Executed in the in-flight executor as :class:`~trtpipe.serving.speculative.DraftModel` is, except for the KV: the
head's layers are extra layers of the target's paged pool (one per MTP layer or head layer, as TensorRT-LLM's
``get_num_spec_layers`` counts them for its KV cache manager: 1 for MTP-Eagle, ``num_nextn_predict_layers`` for
vanilla MTP, utils.py@011d0933), written through each request's own block table. Per request the drafter keeps the
target's hidden states of the positions it has not read yet. After each target step the executor hands over the
step's captured hidden states (:meth:`HiddenDrafter.stepped`); after a verification only the positions whose input
token was kept stay (:meth:`HiddenDrafter.accepted`). The head's KV at positions that read a draft is never kept: the
next round's catch-up rewrites them from the target's hidden states, as TensorRT-LLM's first draft forward does.

A prefix taken from the KV cache (block reuse) brings the head's KV of its positions: the request drafts from its
first step, from the hidden states of the positions its context computes. As upstream, that KV is used as stored: a
head layer's KV at a position near the end of the reused prefix encodes the tokens that followed it in the request
that stored it (the same tokens when the prompts agree there), and a block stored by a request that never drafted
(e.g. a guided one) holds no head KV; either changes what is drafted, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.runtime.linear import Float32Linear
from trtpipe.runtime.model import DecoderLayer, ModelArgs, ReferenceModel, rms_norm
from trtpipe.recipe.speculative import check_mtp_draft_len
from trtpipe.serving.api import StepBatch, StepEntry
from trtpipe.serving.kv_pool import BlockPool
from trtpipe.serving.speculative import draw, sampling_probs

DRAFT_LAYER = "draft"  # the target pool's key prefix of the head's KV layers
FINAL = -1  # a capture index: the target's output after its final norm (what MTP reads)


def eagle3_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads by default (``_get_eagle3_default_capture_layers``, eagle3.py@f933a608)."""
    if num_layers <= 5:
        raise CheckpointError(f"EAGLE-3 needs a target of more than 5 layers (default capture); it has {num_layers}")
    return (1, num_layers // 2 - 1, num_layers - 4)


class MTPLayer(nn.Module):
    """One of DeepSeek-V3's MTP layers (``model.layers.{num_hidden_layers + i}``) over the target's embedding."""

    def __init__(self, target: ReferenceModel, layer: DecoderLayer, extra: dict):
        super().__init__()
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "eh_proj"):
            if name not in extra:
                raise CheckpointError(f"MTP layer {layer.layer_idx}: tensor '{name}' is missing")
        self.eps = target.args.norm_epsilon
        self.layer = layer
        self.enorm, self.hnorm = extra["enorm.weight"], extra["hnorm.weight"]
        self.eh_proj = extra["eh_proj"]
        self.norm = extra["shared_head.norm.weight"]

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, paged, cos_sin) -> torch.Tensor:
        """[1, N, H] embeddings and [1, N, H] hidden states -> [1, N, H] the normed output (the next hidden)."""
        x = self.eh_proj(torch.cat([rms_norm(emb, self.enorm, self.eps), rms_norm(hidden, self.hnorm, self.eps)], -1))
        return rms_norm(self.layer(x, 0, paged, cos_sin), self.norm, self.eps)


class MTPHead(nn.Module):
    """DeepSeek-V3's MTP layers over the target's embedding and lm_head: one layer reused for every draft
    (MTP-Eagle, a checkpoint with one layer) or, ``vanilla``, layer d drafting the (d + 1)-th token."""

    def __init__(self, target: ReferenceModel, layers: list[MTPLayer], vanilla: bool = False):
        super().__init__()
        self.capture = (FINAL,)
        self.target = target
        self.layers = nn.ModuleList(layers)
        self.vanilla = vanilla
        self.depths = len(layers) if vanilla else 1  # layers run one after another per round
        self.eh_proj = layers[0].eh_proj
        self.model = ReferenceModel(
            target.config, target.args, target.embedding, [m.layer for m in layers], layers[0].norm, []
        )
        self.d2t = None

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, paged, cos_sin, depth: int = 0) -> torch.Tensor:
        return self.layers[depth](emb, hidden, paged, cos_sin)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(out) for m in self.target.lm_head], dim=-1)[..., : self.target.args.vocab_size].float()

    def next_hidden(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def drafter(self, target_engine, pool: BlockPool) -> "HiddenDrafter":
        return HiddenDrafter(self, target_engine, pool)


class Eagle3Head(nn.Module):
    """An EAGLE-3 head (``LlamaForCausalLMEagle3``-style checkpoint) over the target's hidden states."""

    def __init__(self, target: ReferenceModel, args: ModelArgs, t: dict, capture: tuple[int, ...]):
        super().__init__()
        H = args.hidden_size
        self.capture, self.args, self.eps, self.target = capture, args, args.norm_epsilon, target
        pre = "midlayer."
        need = [pre + n for n in ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")]
        need += [pre + f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
            pre + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
        ]
        need += ["norm.weight"]
        for name in need:
            if name not in t:
                raise CheckpointError(f"EAGLE-3 head: tensor '{name}' is missing")
        width = t[pre + "self_attn.q_proj.weight"].shape[1]
        if width != 2 * H:
            raise CheckpointError(f"EAGLE-3 head: q_proj takes {width} inputs; the layer reads [emb; hidden] = {2 * H}")
        rel = {
            "input_layernorm.weight": t[pre + "input_layernorm.weight"],
            "post_layernorm.weight": t[pre + "post_attention_layernorm.weight"],
            "attention.qkv.weight": torch.cat([t[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
            "attention.dense.weight": t[pre + "self_attn.o_proj.weight"],
            "mlp.fc.weight": t[pre + "mlp.gate_proj.weight"],
            "mlp.gate.weight": t[pre + "mlp.up_proj.weight"],
            "mlp.proj.weight": t[pre + "mlp.down_proj.weight"],
        }
        self.layer = DecoderLayer(args, [rel], 0)
        self.hidden_norm = t[pre + "hidden_norm.weight"]
        self.norm = t["norm.weight"]
        n_in = len(capture) * target.args.hidden_size
        self.fc = None
        if "fc.weight" in t:
            if t["fc.weight"].shape[1] != n_in:
                raise CheckpointError(
                    f"EAGLE-3 head: fc takes {t['fc.weight'].shape[1]} inputs; {len(capture)} captured target layers "
                    f"of {target.args.hidden_size} give {n_in}"
                )
            self.fc = Float32Linear(t["fc.weight"], t.get("fc.bias"))
        elif n_in != H:
            raise CheckpointError("EAGLE-3 head: tensor 'fc.weight' is missing")
        self.embedding = t.get("embed_tokens.weight", target.embedding)
        self.lm_head = t.get("lm_head.weight")
        if self.lm_head is None:
            self.lm_head = target.lm_head[0].weight if len(target.lm_head) == 1 else None
        if self.lm_head is None or self.lm_head.shape[1] != H:
            raise CheckpointError("EAGLE-3 head: tensor 'lm_head.weight' is missing (and the target's is not usable)")
        self.d2t = t.get("d2t")
        if self.lm_head.shape[0] != target.args.vocab_size and self.d2t is None:
            raise CheckpointError(
                f"EAGLE-3 head: draft vocab {self.lm_head.shape[0]} differs from the target's "
                f"{target.args.vocab_size} and there is no d2t map"
            )
        if self.d2t is not None:
            self.d2t = self.d2t.long()
            top = int((torch.arange(len(self.d2t)) + self.d2t).max())
            if len(self.d2t) != self.lm_head.shape[0] or top >= target.args.vocab_size:
                raise CheckpointError("EAGLE-3 head: d2t does not map the draft vocabulary into the target's")
        self.model = ReferenceModel(
            {"max_position_embeddings": args.max_position_embeddings}, args, self.embedding, [self.layer], self.norm, []
        )
        self.tree: Optional[list[list[int]]] = None  # eagle_choices with siblings (None: the chain)
        self.tree_drafter: Optional[type] = None  # what drafts the tree (None: HiddenDrafter, the chain)

    depths, vanilla = 1, False  # one layer, reused for every draft

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, paged, cos_sin, depth: int = 0) -> torch.Tensor:
        """[1, N, H] embeddings and [1, N, 3 x H_target] captures (or [1, N, H], a previous draft's) -> x [1, N, H]."""
        g = self.fc(hidden) if hidden.shape[-1] != self.args.hidden_size else hidden
        layer = self.layer
        h = torch.cat([rms_norm(emb, layer.input_ln, self.eps), rms_norm(g, self.hidden_norm, self.eps)], dim=-1)
        cos, sin = cos_sin["global"]
        x = g + layer.attention[0](h, cos, sin, 0, paged, (0, 0))
        return x + layer.mlp[0](rms_norm(x, layer.post_ln, self.eps))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.norm, self.eps) @ self.lm_head.T).float()

    def next_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def drafter(self, target_engine, pool: BlockPool) -> "HiddenDrafter":
        # a static tree drafts level by level: the loader sets tree_drafter with tree (eagle1.Eagle1TreeDrafter)
        return (self.tree_drafter or HiddenDrafter)(self, target_engine, pool)


def mtp_layer_count(model_dir: str | Path) -> int:
    """``num_nextn_predict_layers`` of a checkpoint's config.json (0 when absent)."""
    return int(load_json(Path(model_dir) / "config.json").get("num_nextn_predict_layers") or 0)


def load_mtp_head(model_dir: str | Path, target: ReferenceModel, max_draft_len: Optional[int] = None) -> MTPHead:
    """The MTP layers of a DeepSeek-V3 checkpoint (``model.layers.{num_hidden_layers + i}``).

    Which path runs is TensorRT-LLM's ``MTPDecodingConfig.spec_dec_mode`` (``llm_args.py@00043967``): one layer and
    ``use_mtp_vanilla`` off ->
    MTP-Eagle, that layer reused for every draft; more layers -> vanilla MTP, layer d drafting the (d + 1)-th token
    (``tensorrt_llm/_torch/speculative/utils.py@011d0933``, ``modeling_deepseekv3.py@a43cf9e3``). ``use_mtp_vanilla``
    over a one-layer checkpoint is not a trtpipe knob."""
    from trtpipe.runtime.hf_loader import load_hf_layer

    cfg = load_json(Path(model_dir) / "config.json")
    n = int(cfg.get("num_nextn_predict_layers") or 0)
    if n < 1:
        raise CheckpointError(f"{model_dir}/config.json: num_nextn_predict_layers is {n}: no MTP layer to draft with")
    if max_draft_len is not None and (why := check_mtp_draft_len(n, max_draft_len)):
        raise CheckpointError(f"speculative.max_draft_len {why}")
    first = int(cfg["num_hidden_layers"])
    layers = [MTPLayer(target, *load_hf_layer(model_dir, first + i)) for i in range(n)]
    return MTPHead(target, layers, vanilla=n > 1)


def eagle3_args(cfg: dict, where: str) -> ModelArgs:
    """The head's layer numbers from its config.json (Llama names; ``draft_vocab_size`` the lm_head's rows)."""
    from trtpipe.models.dims import parse_hf_config

    view = {**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    view["vocab_size"] = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    d = parse_hf_config(view, where)
    return ModelArgs(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        num_layers=1,
        num_heads=d.num_heads,
        num_kv_heads=d.num_kv_heads,
        head_size=d.head_dim,
        intermediate_size=d.intermediate_size,
        norm_epsilon=d.rms_norm_eps,
        hidden_act=d.hidden_act,
        rotary_base=d.rope_theta,
        rotary_scaling=d.rope_scaling,
        rotary_dim=d.rotary_dim,
        max_position_embeddings=d.max_position_embeddings,
    )


def load_eagle3_head(head_dir: str | Path, target: ReferenceModel) -> Eagle3Head:
    """An EAGLE-3 head directory: config.json and model.safetensors (or pytorch_model.bin), tensor names as the
    published heads store them (``midlayer.*`` or ``layers.0.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)."""
    d = Path(head_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"EAGLE-3 head: {cfg_path} not found")
    cfg = load_json(cfg_path, CheckpointError)
    if (d / "model.safetensors").is_file():
        from safetensors.torch import load_file

        raw = load_file(str(d / "model.safetensors"))
    elif (d / "pytorch_model.bin").is_file():
        raw = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"EAGLE-3 head: no model.safetensors or pytorch_model.bin in {d}")
    t = {}
    for k, v in raw.items():
        k = k[len("model.") :] if k.startswith("model.") and not k.startswith("model.layers.") else k
        k = k.replace("model.layers.0.", "midlayer.").replace("layers.0.", "midlayer.")
        t[k] = v if k in ("d2t", "t2d") else v.float()
    # upstream's default capture; speculative_config.eagle3_layers_to_capture (llm_args) is not a twin knob, and
    # vLLM's eagle_aux_hidden_state_layer_ids count the embedding as 0, a different convention: neither is read
    capture = eagle3_capture_layers(target.args.num_layers)
    args = eagle3_args(cfg, str(cfg_path))
    if args.hidden_size != int(cfg.get("target_hidden_size") or target.args.hidden_size):
        raise CheckpointError(f"{cfg_path}: hidden_size {args.hidden_size} differs from the target's")
    return Eagle3Head(target, args, t, capture)


# ---- execution -----------------------------------------------------------------------------------------------------


@dataclass
class _State:
    cached: list[int]  # per layer (depth): head KV valid below this position
    start: int = 0  # position of rows[0]
    rows: Optional[torch.Tensor] = None  # the target's captured hidden states of positions start..


def require_hidden_states(target_engine, what: str) -> None:
    """Refuse, in one line, a target engine that does not keep its hidden states for a head."""
    if not getattr(target_engine, "captures_hidden_states", False):
        raise ValueError(
            f"{what} drafting reads the target's hidden states: the twin runs it on the in-process reference "
            "engine or on rank 0 of mpirun ranks at pp 1 without attention DP (not at pp > 1, under attention DP, "
            "nor under LoRA adapters)"
        )


class HiddenDrafter:
    """A head drafting from the target's hidden states. Its KV is extra layers of the target's paged pool: written
    through each request's own block table, so a prefix taken from the KV cache brings the head's KV with it."""

    def __init__(self, head, target_engine, pool: BlockPool):
        require_hidden_states(target_engine, "MTP / Eagle3")
        self.head, self.target, self.pool = head, target_engine, pool
        self.depths, self.vanilla = head.depths, head.vanilla
        target_engine.capture = head.capture
        # the reference engine's packing and paged attention in this process (the class that sets the flag True, not
        # a subclass: under mpirun rank 0's RankEngine decides it by a property, mpi_engine.RankEngine)
        engine_cls = next(c for c in type(target_engine).__mro__ if c.__dict__.get("captures_hidden_states") is True)
        self.engine = engine_cls(head.model)
        self.engine.allocate(pool.num_blocks, pool.tokens_per_block)
        for (layer, rank), pair in self.engine.pools.items():  # the same tensors, as the target pool's extra layers
            target_engine.pools[(DRAFT_LAYER, layer, rank)] = pair
        self.state: dict[int, _State] = {}
        self.vocab = target_engine.model.args.vocab_size

    def forget(self, request_id: int) -> None:
        self.state.pop(request_id, None)

    def stepped(self, batch: StepBatch) -> None:
        """After a target step: keep every entry's captured hidden states (the rows of its positions)."""
        h = self.target.captured
        if h is None:
            return
        t = 0
        for e in batch.entries:
            n = len(e.tokens)
            rows, t = h[t : t + n], t + n
            st = self.state.get(e.request_id)
            if st is None:
                # a first context that starts past 0 took its prefix from the KV cache: the blocks hold the head's
                # KV of those positions too (TensorRT-LLM keeps its draft layers in the target's KV cache manager)
                st = self.state[e.request_id] = _State([e.start_pos] * self.depths, e.start_pos, rows)
                continue
            if st.rows is None or e.start_pos < st.start:
                st.start, st.rows = e.start_pos, rows
            else:
                st.rows = torch.cat([st.rows[: e.start_pos - st.start], rows])
            st.cached = [min(c, e.start_pos) for c in st.cached]  # a recomputed context (a paused request) starts over

    def kept(self, request_id: int, start_pos: int, accepted: list[int]) -> None:
        """After a masked verification at ``start_pos``: the rows of its root and accepted drafts, in that order."""
        from trtpipe.serving.tree_verify import kept_rows

        st = self.state.get(request_id)
        if st is not None and st.rows is not None and st.start <= start_pos < st.start + len(st.rows):
            off = start_pos - st.start
            st.rows = torch.cat([st.rows[:off], kept_rows(st.rows[off:], accepted)])

    def accepted(self, request_id: int, valid: int) -> None:
        """After a verification: the target's hidden states are kept for positions below ``valid`` only."""
        st = self.state.get(request_id)
        if st is not None and st.rows is not None:
            st.rows = st.rows[: max(0, valid - st.start)]

    def _map(self, d: int) -> int:
        return d if self.head.d2t is None else d + int(self.head.d2t[d])

    def _forward(self, entries: list[StepEntry], hidden: torch.Tensor, depth: int = 0):
        ids, paged, cos_sin, ends = self.engine.packed(StepBatch(-1, entries))
        emb = torch.nn.functional.embedding(ids, self.head.model.embedding)
        out = self.head(emb, hidden[None], paged, cos_sin, depth)[0, ends]  # [R, H]
        return self.head.logits(out), self.head.next_hidden(out)

    def _choose(self, r, row: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
        """A draft from one row of logits (argmax, or drawn under the request's sampling) and, when sampled, the
        distribution it was drawn from over the target's vocabulary."""
        s = r.request.sampling
        if s.greedy:
            return self._map(int(row.argmax())), None
        q = sampling_probs(row, s)
        d = draw(q, r.generator)
        full = torch.zeros(self.vocab, dtype=q.dtype)
        idx = torch.arange(len(q)) if self.head.d2t is None else torch.arange(len(q)) + self.head.d2t
        return self._map(d), full.index_add_(0, idx, q)

    def _ready(self, r, k: int) -> bool:
        """The request has the target's hidden states of every position its first k layers read."""
        st = self.state.get(r.id)
        n = len(r.tokens)
        if st is None or st.rows is None or st.start + len(st.rows) < n - 1:
            return False
        reads = [min(st.cached[d] + (d if self.vanilla else 0), n - 1) for d in range(min(k, self.depths))]
        return all(st.cached[d] <= n - 2 and st.start <= reads[d] for d in range(len(reads)))

    @torch.no_grad()
    def propose(self, requests: list, ks: dict[int, int]) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        """k drafts per request (with the distributions they were drawn from, over the target's vocabulary, when
        sampling)."""
        live = [r for r in requests if self._ready(r, ks[r.id])]
        if not live:
            return {}
        if self.vanilla:
            out = self._propose_vanilla(live, ks)
        else:
            out = self._propose_reused(live, ks)
        for r in live:  # rows are kept from the first position a later catch-up reads
            st, n = self.state[r.id], len(r.tokens)
            keep = min([n - 1] + [c + (d if self.vanilla else 0) for d, c in enumerate(st.cached)])
            st.rows, st.start = st.rows[keep - st.start :], keep
        return {i: (d, torch.stack(q) if q else None) for i, (d, q) in out.items()}

    def _propose_reused(self, live: list, ks: dict[int, int]) -> dict:
        """One layer reused (MTP-Eagle, EAGLE-3): one packed catch-up forward over every request's unread positions
        (token j + 1 with the target's hidden state j), then k - 1 single steps at positions n - 1.. (the head's
        own output with the token it drafted). Those steps' KV is rewritten by the next catch-up."""
        entries, hidden, ks = [], [], dict(ks)
        for r in live:
            st, n, table = self.state[r.id], len(r.tokens), r.block_table
            while ks[r.id] > 1 and self.pool.blocks_for(n - 2 + ks[r.id]) - len(table) > self.pool.num_free:
                ks[r.id] -= 1  # the draft steps' positions need blocks the pool does not have: fewer drafts
            r.perf.kv_alloc_new_blocks += self.pool.grow(table, n - 2 + ks[r.id])
            c = st.cached[0]
            entries.append(StepEntry(r.id, r.tokens[c + 1 : n], c, table, True, True))
            hidden.append(st.rows[c - st.start : n - 1 - st.start])
        out = {r.id: ([], []) for r in live}
        h = torch.cat(hidden)
        for step in range(max(ks[r.id] for r in live)):
            logits, nxt_hidden = self._forward(entries, h)
            nxt, nh = [], []
            for i, r in enumerate([x for x in live if len(out[x.id][0]) < ks[x.id]]):
                tok, q = self._choose(r, logits[i])
                out[r.id][0].append(tok)
                if q is not None:
                    out[r.id][1].append(q)
                if len(out[r.id][0]) < ks[r.id]:
                    nxt.append(StepEntry(r.id, [tok], len(r.tokens) - 1 + step, r.block_table, False, True))
                    nh.append(nxt_hidden[i : i + 1])
            if not nxt:
                break
            entries, h = nxt, torch.cat(nh)
        for r in live:  # the head KV is the target's up to n - 2; its own drafts' positions are rewritten
            self.state[r.id].cached[0] = len(r.tokens) - 1
        return out

    def _propose_vanilla(self, live: list, ks: dict[int, int]) -> dict:
        """Vanilla MTP (TensorRT-LLM's ``MTPWorker.forward``, ``tensorrt_llm/_torch/speculative/mtp.py@000a01de``):
        layer d (0-based) drafts token d + 1. Over positions j it reads the stream shifted by d: token s[j + d + 1]
        with hidden state G[j + d], where s is the sequence then the drafts so far and G the target's hidden states
        then, past the last position, each earlier layer's output at the last position (the docstring's MTP2 reading
        tokens CDEF against H_B, H_C, H_D, h_E). Every layer writes positions up to n - 2 only, in its own KV; the
        positions that read a draft (j > n - 2 - d) are rewritten by the next round's catch-up from the target's
        hidden states (upstream keeps them when its window has moved past: a draft-quality difference only)."""
        out = {r.id: ([], []) for r in live}
        outs: dict[int, list[torch.Tensor]] = {r.id: [] for r in live}
        for d in range(min(max(ks[r.id] for r in live), self.depths)):
            batch, entries, hidden = [], [], []
            for r in live:
                if ks[r.id] <= d or len(out[r.id][0]) < d:
                    continue
                st, n = self.state[r.id], len(r.tokens)
                c = st.cached[d]
                seq = r.tokens + out[r.id][0]
                settled = st.rows[c + d - st.start : n - 1 - st.start] if c + d <= n - 2 else st.rows[:0]
                drafted = outs[r.id][max(0, c + d - (n - 1)) : d]
                entries.append(StepEntry(r.id, seq[c + d + 1 : n + d], c, r.block_table, True, True))
                hidden.append(torch.cat([settled, *drafted]))
                batch.append(r)
            if not batch:
                break
            logits, nxt_hidden = self._forward(entries, torch.cat(hidden), d)
            for i, r in enumerate(batch):
                tok, q = self._choose(r, logits[i])
                out[r.id][0].append(tok)
                if q is not None:
                    out[r.id][1].append(q)
                outs[r.id].append(nxt_hidden[i : i + 1])
                self.state[r.id].cached[d] = len(r.tokens) - 1 - d
        return out
