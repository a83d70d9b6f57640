"""The reference runtime as a step engine: one packed forward per step over a paged KV pool.

Every scheduled token of a step (context chunks and one token per generating request) is packed into one
``[1, N]`` sequence: embedding, norms, linears and MLPs run once over all N tokens, with no padding to the
longest row. Only attention is per request: each query reads its own request's keys through its block table.
Contexts attend causally over their cached prefix plus the chunk; generation tokens are gathered into one
``[G, S_max]`` batch (masked past each row's length), as a decode kernel would.

The pool is one ``[num_blocks * tokens_per_block, kv_heads, head_dim]`` tensor per (layer, tp rank) for keys
and one for values; slot ``block * tokens_per_block + offset`` holds position ``i * tokens_per_block + offset``
of the request whose table has ``block`` at index ``i``.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.runtime.generate import sample
from trtpipe.runtime.model import ReferenceModel, attention_probs, rms_norm
from trtpipe.serving.api import ExecutorConfig, StepBatch, StepResult
from trtpipe.serving.logprobs import ban_tokens, chosen_logprobs, rows_of, split_rows
from trtpipe.serving.draft_logits import kept_rows
from trtpipe.serving.hidden_draft import FINAL
from trtpipe.serving.speculative import DRAFT_TARGET, EAGLE, EAGLE3, MEDUSA, MTP, verify_entries
from trtpipe.serving.tree_verify import as_mask, move_slots, spec_rope_positions

log = logging.getLogger(__name__)


def _slots(block_table: list[int], start: int, end: int, tpb: int) -> list[int]:
    """Pool slots of positions start..end-1 through ``block_table``."""
    return [block_table[p // tpb] * tpb + p % tpb for p in range(start, end)]


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[..., T, S] mask: causal (key position <= query position), within the sliding window if any."""
    allowed = k_pos[..., None, :] <= q_pos[..., :, None]
    if window:
        allowed &= (q_pos[..., :, None] - k_pos[..., None, :]) < window
    return allowed


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Grouped-query attention. q [R, nkv, g, T, d]; k, v [R, nkv, S, d]; allowed [R, T, S] -> [R, nkv, g, T, d].
    ``scale``: the score scale when it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar ** -0.5); ``sinks``:
    gpt-oss's per-head sink logits [nkv * g] (:func:`~trtpipe.runtime.model.attention_probs`)."""
    scores = q @ k[:, :, None].transpose(-1, -2)  # [R, nkv, g, T, S]
    d = q.shape[-1]
    scores = scores / math.sqrt(d) if scale is None or scale == d**-0.5 else scores * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    sinks = None if sinks is None else sinks.view(1, q.shape[1], q.shape[2], 1, 1)
    return attention_probs(scores, sinks) @ v[:, :, None]


class PagedStep:
    """One step's view of the pool, handed to the attention shards as their ``cache`` (they call :meth:`attend`)."""

    def __init__(self, pools: dict, batch: StepBatch, tpb: int, device):
        self.pools = pools
        slots, ctx, gen_rows, gen_slots, gen_pos = [], [], [], [], []
        t = 0
        for e in batch.entries:
            n = len(e.tokens)
            slots += _slots(e.block_table, e.start_pos, e.start_pos + n, tpb)
            if e.is_context or n > 1:  # a context chunk, or a token with drafts to verify: causal over its KV
                kv = torch.tensor(_slots(e.block_table, 0, e.start_pos + n, tpb), device=device)
                q_pos = torch.arange(e.start_pos, e.start_pos + n, device=device)
                k_pos, spec = torch.arange(e.start_pos + n, device=device), None
                if e.spec_mask is not None:  # drafts as a token set (trtpipe.serving.tree_verify): its own mask
                    q_pos = torch.tensor(spec_rope_positions(e) or range(e.start_pos, e.start_pos + n), device=device)
                    k_pos = torch.cat([k_pos[: e.start_pos], q_pos])
                    spec = as_mask(e.spec_mask, n).to(device)
                ctx.append((t, t + n, kv, q_pos, k_pos, spec))
            else:
                gen_rows.append(t)
                gen_slots.append(e.block_table)
                gen_pos.append(e.start_pos)
            t += n
        self.slots = torch.tensor(slots, device=device)
        self.ctx = ctx
        self.gen_rows = torch.tensor(gen_rows, dtype=torch.long, device=device)
        if gen_rows:
            # slots of positions 0..S-1 through each row's block table, padded with block 0 (masked below)
            blocks = max(len(b) for b in gen_slots)
            tables = torch.tensor([list(b) + [0] * (blocks - len(b)) for b in gen_slots], device=device)  # [G, B]
            width = max(gen_pos) + 1
            self.gen_kpos = torch.arange(width, device=device)  # [S]
            self.gen_slots = tables[:, self.gen_kpos // tpb] * tpb + self.gen_kpos % tpb  # [G, S]
            self.gen_pos = torch.tensor(gen_pos, device=device)  # [G]
        self._masks: dict = {}

    def _mask(self, window: Optional[int]):
        """Per-window masks (computed once per step, shared by every layer)."""
        if window not in self._masks:
            ctx = []
            for *_, q_pos, k_pos, spec in self.ctx:
                allowed = _allowed(q_pos, k_pos, window)
                if spec is not None:  # the new tokens see each other as the mask says (window in positions)
                    new = spec.clone()
                    if window:
                        new &= (q_pos[:, None] - q_pos[None, :]) < window
                    allowed[:, -len(q_pos) :] = new
                ctx.append(allowed[None])
            gen = None
            if len(self.gen_rows):
                gen = _allowed(self.gen_pos[:, None], self.gen_kpos, window)  # [G, 1, S]; hides the padding too
            self._masks[window] = (ctx, gen)
        return self._masks[window]

    def attend(
        self,
        key,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: Optional[int],
        scale: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """q [1, nh, N, d], k/v [1, nkv, N, d] of the packed tokens -> attention output [1, N, nh * d]."""
        kp, vp = self.pools[key]
        _, nh, N, d = q.shape
        nkv = k.shape[1]
        g = nh // nkv
        kp[self.slots] = k[0].transpose(0, 1)  # [N, nkv, d]
        vp[self.slots] = v[0].transpose(0, 1)
        qt = q[0].view(nkv, g, N, d)
        out = torch.empty(nkv, g, N, d, dtype=q.dtype, device=q.device)
        ctx_masks, gen_mask = self._mask(window)
        for (t0, t1, kv, *_), allowed in zip(self.ctx, ctx_masks):
            kc = kp[kv].permute(1, 0, 2)[None]  # [1, nkv, S, d]
            vc = vp[kv].permute(1, 0, 2)[None]
            out[:, :, t0:t1] = _attention(qt[None, :, :, t0:t1], kc, vc, allowed, scale, sinks)[0]
        if len(self.gen_rows):
            qg = qt[:, :, self.gen_rows].permute(2, 0, 1, 3)[:, :, :, None]  # [G, nkv, g, 1, d]
            kg = kp[self.gen_slots].permute(0, 2, 1, 3)  # [G, nkv, S, d]
            vg = vp[self.gen_slots].permute(0, 2, 1, 3)
            og = _attention(qg, kg, vg, gen_mask, scale, sinks)  # [G, nkv, g, 1, d]
            out[:, :, self.gen_rows] = og[:, :, :, 0].permute(1, 2, 0, 3)
        return out.view(nh, N, d).transpose(0, 1).reshape(1, N, nh * d)

    def attend_latent(self, key, q: torch.Tensor, latent: torch.Tensor, expand, scale: float) -> torch.Tensor:
        """MLA (DeepSeek-V3): q [1, nh, N, qk] and the packed tokens' latents [1, 1, N, L] -> [1, N, nh * v].

        Only the latents are written to the pool (L = kv_lora_rank + qk_rope_head_dim values per token); each
        request's keys and values are expanded from its cached latents (``expand``: [.., 1, S, L] -> k [.., nh, S, qk],
        v [.., nh, S, v]) for this step's attention."""
        kp, _ = self.pools[key]
        kp[self.slots] = latent[0].transpose(0, 1)  # [N, 1, L]
        _, nh, N, _ = q.shape
        outs = [None] * N
        ctx_masks, gen_mask = self._mask(None)
        for (t0, t1, kv, *_), allowed in zip(self.ctx, ctx_masks):
            k, v = expand(kp[kv].transpose(0, 1)[None])  # [1, nh, S, qk], [1, nh, S, v]
            o = _attention(q[:, :, None, t0:t1], k, v, allowed, scale)[0, :, 0]  # [nh, T, v]
            outs[t0:t1] = o.transpose(0, 1)
        if len(self.gen_rows):
            k, v = expand(kp[self.gen_slots].transpose(1, 2))  # [G, 1, S, L] -> [G, nh, S, qk], [G, nh, S, v]
            qg = q[0][:, self.gen_rows].transpose(0, 1)[:, :, None, None]  # [G, nh, 1, 1, qk]
            og = _attention(qg, k, v, gen_mask, scale)[:, :, 0, 0]  # [G, nh, v]
            for i, row in enumerate(self.gen_rows.tolist()):
                outs[row] = og[i]
        return torch.stack(outs).reshape(1, N, -1)


def sample_entries(batch: StepBatch, logits: torch.Tensor) -> tuple[dict[int, int], dict[int, str]]:
    """One token per sampling entry from its row of ``logits`` [S, V]: one argmax for every greedy row at once,
    the request's own settings and generator for the others.

    Returns:
        The tokens, and one line per entry whose row could not be sampled: each row is sampled under its own
        guard, so one request's failure is its own (the executor fails that request and keeps the others).
    """
    rows = [e for e in batch.entries if e.sample]
    if any(e.banned is not None or e.allowed is not None for e in rows):
        logits = logits.clone()  # min_tokens and guided rows: the caller's raw logits (logprobs) stay as they were
        ban_tokens(batch, logits)
    tokens, errors = {}, {}
    for i, e in enumerate(rows):  # guided rows: what the grammar forbids cannot be sampled, greedy or not
        if e.allowed is not None:
            try:
                allowed = e.allowed[: logits.shape[-1]]
                logits[i, : allowed.numel()].masked_fill_(~allowed, float("-inf"))
                logits[i, allowed.numel() :] = float("-inf")  # padded vocabulary past the tokenizer's
            except Exception as exc:  # noqa: BLE001 - the row's own failure
                errors[e.request_id] = f"{type(exc).__name__}: {exc}"
    greedy = logits.argmax(-1).tolist()  # what sample() returns at temperature 0, for all rows in one call
    for i, e in enumerate(rows):
        s = e.sampling
        if e.request_id in errors:
            continue
        try:
            tokens[e.request_id] = (
                greedy[i] if s.greedy else sample(logits[i], s.temperature, s.top_k, s.top_p, e.generator)
            )
        except Exception as exc:  # noqa: BLE001 - the row's own failure, answered to its request alone
            log.exception("request %d could not be sampled", e.request_id)
            errors[e.request_id] = f"{type(exc).__name__}: {exc}"
    return tokens, errors


class ReferenceEngine:
    """:class:`~trtpipe.serving.api.StepEngine` over a :class:`ReferenceModel` (any tp/pp, quantized or not)."""

    # its own logits() keeps the hidden states ``capture`` names (an engine overriding logits() sets this False)
    captures_hidden_states = True

    def __init__(self, model: ReferenceModel):
        self.model = model
        # a pipeline stage other than the first (trtpipe.runtime.distributed) holds no embedding
        self.device = model.embedding.device if model.embedding is not None else torch.device("cpu")
        self.pools: dict = {}
        self.tokens_per_block = 0
        # per rope (Gemma 3: "global" and "local"): one table for all positions unless the kind is "dynamic"
        limit = int(model.config.get("max_position_embeddings") or 0) or 4096
        self._tables = {key: rope.cos_sin(0, limit) for key, rope in model.ropes.items() if rope.kind != "dynamic"}
        # layers whose outputs each step keeps for a hidden-state drafter (trtpipe.serving.hidden_draft), in order
        # (FINAL: the output after the final norm); ``captured``: the last step's, [N, H x len(capture)]
        self.capture: tuple[int, ...] = ()
        self.captured: Optional[torch.Tensor] = None

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.pools = {}
        for layer in self.model.layers:
            for r, shard in enumerate(layer.attention):
                shape = (num_blocks * tokens_per_block, shard.nkv, shard.d)
                v_width = getattr(shard, "dv_cache", shard.d)  # MLA caches no value (trtpipe.runtime.mla)
                self.pools[(layer.layer_idx, r)] = (
                    torch.zeros(shape, device=self.device),
                    torch.zeros(shape[:-1] + (v_width,), device=self.device),
                )

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        tpb = self.tokens_per_block
        for k, v in self.pools.values():
            k[dst * tpb : dst * tpb + num_tokens] = k[src * tpb : src * tpb + num_tokens]
            v[dst * tpb : dst * tpb + num_tokens] = v[src * tpb : src * tpb + num_tokens]

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        move_slots(self.pools, src, dst)

    def _cos_sin(self, batch: StepBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per rope key, [N, rot] tables of every packed token's position."""
        return {key: self._rope_rows(key, rope, batch) for key, rope in self.model.ropes.items()}

    def _rope_rows(self, key: str, rope, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        top = max(e.start_pos + len(e.tokens) for e in batch.entries)
        table = self._tables.get(key)
        if table is not None and top > table[0].shape[0]:
            table = self._tables[key] = rope.cos_sin(0, max(top, 2 * table[0].shape[0]))
        spec = [spec_rope_positions(e) for e in batch.entries]  # a masked entry's own positions
        if table is not None:
            pos = torch.cat(
                [
                    torch.tensor(p) if p is not None else torch.arange(e.start_pos, e.start_pos + len(e.tokens))
                    for e, p in zip(batch.entries, spec)
                ]
            )
            return table[0][pos].to(self.device), table[1][pos].to(self.device)
        parts = [
            rope.cos_sin(e.start_pos, len(e.tokens))
            if p is None
            else tuple(x[torch.tensor(p) - e.start_pos] for x in rope.cos_sin(e.start_pos, max(p) - e.start_pos + 1))
            for e, p in zip(batch.entries, spec)
        ]
        return torch.cat([c for c, _ in parts]).to(self.device), torch.cat([s for _, s in parts]).to(self.device)

    def packed(self, batch: StepBatch):
        """The packed step's inputs: ids [1, N], the paged view of the pool, cos/sin [N, rot], and the packed
        indices whose logits the step needs: the last token of every entry that samples, and the positions that
        score an entry's prompt targets (:func:`~trtpipe.serving.logprobs.rows_of`; shared with the
        one-process-per-rank engine)."""
        ids = torch.tensor([[t for e in batch.entries for t in e.tokens]], device=self.device)  # [1, N]
        paged = PagedStep(self.pools, batch, self.tokens_per_block, self.device)
        return ids, paged, self._cos_sin(batch), rows_of(batch)[0]

    @torch.no_grad()
    def logits(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [R, V] of the rows :func:`~trtpipe.serving.logprobs.rows_of` names, in that order."""
        ids, paged, cos_sin, ends = self.packed(batch)
        x = self.model.embed(ids)  # [1, N, H]
        captured = []
        for layer in self.model.layers:
            x = layer(x, 0, paged, cos_sin)
            if layer.layer_idx in self.capture:
                captured.append(x[0])
        if FINAL in self.capture:
            captured.append(rms_norm(x[0], self.model.ln_f, self.model.args.norm_epsilon))
        self.captured = torch.cat(captured, dim=-1) if captured else None
        return self.model.head(x[:, ends]).float()[0]

    def step(self, batch: StepBatch) -> StepResult:
        t0 = time.perf_counter()
        logits = self.logits(batch)
        _, sample_at, prompt_at = rows_of(batch)
        sampled_rows = kept_rows(batch, logits, sample_at) if any(e.keep_logits for e in batch.entries) else {}
        logits, prompt = split_rows(batch, logits, sample_at, prompt_at) if prompt_at else (logits, {})
        accepted: dict = {}
        kept: dict = {}  # masked entries: the accepted drafts' indices (trtpipe.serving.tree_verify)
        targets: dict = {}  # masked greedy entries: every row's token (trtpipe.serving.lookahead)
        if any(e.verifies_drafts for e in batch.entries):  # k + 1 rows for each entry with drafts
            tokens, errors, accepted = verify_entries(batch, logits, sample_entries, kept, targets)
        else:
            tokens, errors = sample_entries(batch, logits)
        chosen = chosen_logprobs(batch, logits, tokens)
        return StepResult(
            tokens,
            time.perf_counter() - t0,
            errors,
            logprobs=chosen,
            prompt_logprobs=prompt,
            accepted=accepted,
            kept=kept,
            targets=targets,
            logits=sampled_rows,
        )


def _is_medusa_checkpoint(path: Path) -> bool:
    from trtpipe.checkpoint.medusa import ARCHITECTURE

    cfg = path / "config.json"
    return cfg.is_file() and load_json(cfg, CheckpointError).get("architecture") == ARCHITECTURE


def draft_engine(config: ExecutorConfig, target: Optional[ReferenceModel] = None, target_dir=None):
    """What drafts for the target a front end hands the executor: the draft model's step engine (DraftTarget), the
    MTP layer of the target's checkpoint ``target_dir`` (MTP), the EAGLE-3 head (Eagle3), the Medusa heads (Medusa)
    or the EAGLE-1/2 head (Eagle) over ``target``; None otherwise."""
    kind = config.speculative_decoding_type
    if kind not in (DRAFT_TARGET, MTP, EAGLE3, MEDUSA, EAGLE):
        return None
    if kind != MTP and not config.speculative_model:
        raise ValueError(f"speculative decoding_type {kind} needs a draft model or head (speculative_model)")
    if kind == DRAFT_TARGET:
        from trtpipe.runtime.hf_loader import load_hf_checkpoint

        return ReferenceEngine(load_hf_checkpoint(config.speculative_model))
    from trtpipe.serving.hidden_draft import load_eagle3_head, load_mtp_head

    if target is None:
        raise ValueError(f"speculative decoding_type {kind} drafts from the target model: pass it")
    if kind == MTP:
        if target_dir is None:
            raise ValueError(
                "speculative decoding_type MTP reads the target checkpoint's MTP layer: pass its directory"
            )
        return load_mtp_head(target_dir, target, config.max_draft_len)
    if kind == MEDUSA:
        from trtpipe.serving.medusa import is_chain, load_medusa_heads, sorted_choices

        # the heads built into the engine's checkpoint when the target is one (the Triton twin), else the recipe's
        medusa_ckpt = target_dir is not None and _is_medusa_checkpoint(Path(target_dir))
        heads = load_medusa_heads(target_dir if medusa_ckpt else config.speculative_model, target)
        if config.medusa_choices and not is_chain(config.medusa_choices):  # a tree (trtpipe.serving.tree_verify)
            heads.choices = sorted_choices(config.medusa_choices)
        depth = max((len(c) for c in config.medusa_choices), default=0) if heads.choices else config.max_draft_len
        if depth > heads.num_heads:
            raise ValueError(
                f"speculative.max_draft_len {config.max_draft_len}: Medusa choices {depth} deep need one head per "
                f"level; {config.speculative_model} has {heads.num_heads}"
            )
        return heads
    if kind == EAGLE:
        from trtpipe.serving.eagle1 import ARCHITECTURE, load_eagle1_head, parse_tree

        # the head built into the engine's checkpoint when the target is one (the Triton twin), else the recipe's
        cfg = Path(target_dir or "") / "config.json"
        built = (
            target_dir is not None
            and cfg.is_file()
            and load_json(cfg, CheckpointError).get("architecture") == ARCHITECTURE
        )
        head = load_eagle1_head(target_dir if built else config.speculative_model, target, target_dir)
        head.tree = parse_tree(config.eagle_choices, config.max_draft_len)  # None: the chain
        return head
    head = load_eagle3_head(config.speculative_model, target)
    if config.dynamic_tree_max_top_k:  # EAGLE-2's dynamic tree (one-model upstream; trtpipe/recipe/eagle.py)
        from trtpipe.serving.dynamic_tree import Eagle3DynamicTreeDrafter

        if config.dynamic_tree_depth < 1 or config.max_draft_len < 1:
            raise ValueError(
                f"dynamic tree: dynamic_tree_depth {config.dynamic_tree_depth} and max_draft_len "
                f"{config.max_draft_len} (its draft tokens) must be >= 1"
            )
        head.dynamic = (config.dynamic_tree_max_top_k, config.dynamic_tree_depth)
        head.tree_drafter = Eagle3DynamicTreeDrafter
        return head
    if config.eagle_choices:  # EAGLE-3's static tree (two-model upstream; trtpipe/recipe/eagle.py)
        from trtpipe.serving.eagle1 import Eagle1TreeDrafter, parse_tree

        head.tree = parse_tree(config.eagle_choices, config.max_draft_len)
        head.tree_drafter = Eagle1TreeDrafter if head.tree is not None else None
    return head
