"""Speculative decoding in the in-flight batching executor: draft k tokens, verify k + 1 positions in one target
forward, accept the longest agreeing prefix plus the target's own next token.

What TensorRT-LLM's PyTorch backend calls ``speculative_config`` (``decoding_type`` NGram or DraftTarget,
``max_draft_len``, ``max_matching_ngram_size``; ``tensorrt_llm/llmapi/llm_args.py@fcd3f316``), executed on the
reference runtime:

- **Drafting.** NGram looks the sequence's last ``n`` tokens (``n`` = max_matching_ngram_size down to 1) up in the
  sequence itself and proposes what followed their earliest occurrence (a per-request pool, upstream's
  ``is_public_pool: false`` with ``is_use_oldest: true``; transformers' prompt lookup does the same). DraftTarget runs
  a draft model over its own paged KV: one packed forward catches every request's draft cache up (its first one is
  the draft's prefill), then k - 1 packed single-token steps. MTP and Eagle3 draft the same way with a head over the
  target's hidden states (:mod:`trtpipe.serving.hidden_draft`).
- **Verification.** The target reads ``[last token, d1..dk]`` at positions ``kv_len..kv_len+k`` in one entry of the
  step over the paged KV (:mod:`trtpipe.serving.reference_engine`), giving k + 1 rows of logits.
- **Acceptance.** Greedy: the drafts up to the first that differs from the target's argmax, then the target's token
  there (so the output is greedy decoding's, token for token). Sampling: speculative rejection sampling (Leviathan et
  al. 2023, Chen et al. 2023): d_i is kept with probability min(1, p(d_i) / q(d_i)); the first rejected position
  draws from max(0, p - q) renormalised; if all k are kept the bonus token draws from p at k + 1. Every emitted
  token is then distributed as the target's sampling distribution p (temperature, top-k, top-p as
  :func:`trtpipe.runtime.generate.sample`). NGram drafts are deterministic: q is one-hot.
- **KV.** Blocks past the accepted length are released after each step (the next step grows them again); KV
  positions past it inside a kept block are never read (attention is causal by position) and are overwritten.
- **Token sets.** A drafter may propose a tree (or any masked set) instead of a chain: its entry carries
  ``spec_positions`` / ``spec_mask`` / ``spec_paths``, acceptance keeps the longest agreeing candidate path, and the
  executor moves the accepted drafts' KV behind the prefix (:mod:`trtpipe.serving.tree_verify`).

The executor reserves ``max_draft_len`` extra positions per generating request when it schedules (tokens per step
and KV blocks), as TensorRT-LLM requires ``max_num_tokens >= batch x (max_draft_len + 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from trtpipe.runtime.generate import MIN_TEMPERATURE
from trtpipe.serving.api import ExecutorConfig, SamplingParams, StepBatch, StepEntry
from trtpipe.serving.kv_pool import BlockPool
from trtpipe.serving.tree_verify import verify_masked

NGRAM, DRAFT_TARGET, MTP, EAGLE3, MEDUSA, LOOKAHEAD = "NGram", "DraftTarget", "MTP", "Eagle3", "Medusa", "Lookahead"
EAGLE = "Eagle"  # EAGLE-1/2 heads (the engine's eagle mode; llm_args' "Eagle" decoding type): trtpipe.serving.eagle1
DECODING_TYPES = (NGRAM, DRAFT_TARGET, MTP, EAGLE3, MEDUSA, LOOKAHEAD, EAGLE)
# drafted by heads over the target's hidden states (trtpipe.serving.hidden_draft, medusa, eagle1)
HIDDEN_STATE_TYPES = (MTP, EAGLE3, MEDUSA, EAGLE)


# ---- drafting ------------------------------------------------------------------------------------------------------


def ngram_draft(tokens: Sequence[int], k: int, max_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest matching suffix of ``tokens``
    (suffix lengths ``max_ngram`` down to 1), or [] when no suffix recurs."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), 0, -1):
        suffix = list(tokens[n_tok - n :])
        for start in range(0, n_tok - n):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


def sampling_probs(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """float64 probabilities [..., V] that :func:`trtpipe.runtime.generate.sample` draws from (same temperature
    floor, top-k, then top-p keeping the top token)."""
    z = logits.double() / max(s.temperature, MIN_TEMPERATURE)
    if s.top_k > 0:
        kth = torch.topk(z, min(s.top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if s.top_p < 1.0:
        sp, order = p.sort(dim=-1, descending=True)
        keep = sp.cumsum(-1) - sp < s.top_p
        keep[..., 0] = True
        p = torch.zeros_like(p).scatter_(-1, order, sp * keep)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(p: torch.Tensor, generator) -> int:
    """One token drawn from probabilities ``p`` with the request's generator."""
    return int(torch.multinomial(p.float(), 1, generator=generator))


def _uniform(generator) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64))


def verify(
    drafts: Sequence[int],
    draft_probs: Optional[torch.Tensor],
    logits: torch.Tensor,
    s: SamplingParams,
    generator=None,
) -> list[int]:
    """The tokens one verification emits: accepted drafts, then one token of the target's.

    Args:
        drafts: the k proposed tokens.
        draft_probs: ``[k, V]`` draft distribution each was drawn from, or None (a deterministic draft: one-hot).
        logits: ``[k + 1, V]`` target logits at the positions of the last token and of d1..dk.
        s: the request's sampling settings.
        generator: the request's own generator (None: torch's default).
    """
    k = len(drafts)
    if s.greedy:
        best = logits.argmax(-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            out.append(best[i])
            if best[i] != d:
                return out
        return out + [best[k]]
    p = sampling_probs(logits, s)  # [k + 1, V]
    out = []
    for i, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and _uniform(generator) < min(1.0, float(p[i, d]) / q_d):
            out.append(d)
            continue
        q = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([d]), 1.0) if draft_probs is None else draft_probs[i]
        residual = (p[i] - q.to(p.dtype)).clamp(min=0)
        out.append(draw(residual / residual.sum() if residual.sum() > 0 else p[i], generator))
        return out
    return out + [draw(p[k], generator)]


def usage_extension(perf) -> dict:
    """Per-request acceptance for an OpenAI ``usage`` (TensorRT-LLM's Triton output names, and OpenAI's own
    ``completion_tokens_details`` prediction counters)."""
    return {
        "completion_tokens_details": {
            "accepted_prediction_tokens": perf.total_accepted_draft_tokens,
            "rejected_prediction_tokens": perf.total_draft_tokens - perf.total_accepted_draft_tokens,
        },
        "speculative_decoding": {
            "acceptance_rate": perf.acceptance_rate,
            "total_accepted_draft_tokens": perf.total_accepted_draft_tokens,
            "total_draft_tokens": perf.total_draft_tokens,
        },
    }


def prometheus_lines(speculator, labels: str) -> list[str]:
    """Cumulative acceptance counters (trtpipe's names, after vLLM's ``spec_decode_num_*_total``: trtllm-serve's
    Prometheus endpoint exports none that this twin could copy)."""
    rows = (
        ("trtllm_spec_decode_draft_tokens_total", speculator.total_draft_tokens),
        ("trtllm_spec_decode_accepted_tokens_total", speculator.total_accepted_draft_tokens),
        ("trtllm_spec_decode_verifications_total", speculator.verifications),
    )
    return [line for name, v in rows for line in (f"# TYPE {name} counter", f"{name}{{{labels}}} {v}")]


def verify_entries(
    batch: StepBatch, logits: torch.Tensor, sample_entries, kept: Optional[dict] = None, targets: Optional[dict] = None
):
    """A step's tokens when some entries verify drafts: ``logits`` has k + 1 rows for those, one for every other
    sampling entry. The others go through ``sample_entries`` (the engine's own sampler) unchanged. An entry with a
    ``spec_mask`` is verified as a token set (:func:`trtpipe.serving.tree_verify.verify_masked`); its accepted drafts'
    indices go into ``kept`` (request id -> indices).

    Returns:
        (tokens, errors, accepted): the last emitted token of every entry, one line per failed entry, and every
        token each verifying entry emitted.
    """
    plain, plain_rows, tokens, errors, accepted = [], [], {}, {}, {}
    i = 0
    for e in batch.entries:
        if not e.sample:
            continue
        n = e.sample_rows
        rows = logits[i : i + n]
        i += n
        if n == 1:
            plain.append(e)
            plain_rows.append(rows)
            continue
        try:
            if e.spec_mask is not None:
                idx, accepted[e.request_id] = verify_masked(e, rows)
                if kept is not None:
                    kept[e.request_id] = idx
                if targets is not None and e.sampling.greedy:  # every row's greedy token (lookahead's window)
                    targets[e.request_id] = rows.argmax(-1).tolist()
            else:
                accepted[e.request_id] = verify(e.drafts, e.draft_probs, rows, e.sampling, e.generator)
            tokens[e.request_id] = accepted[e.request_id][-1]
        except Exception as exc:  # noqa: BLE001 - the row's own failure, answered to its request alone
            errors[e.request_id] = f"{type(exc).__name__}: {exc}"
    if plain:
        more, more_errors = sample_entries(StepBatch(batch.iteration, plain), torch.cat(plain_rows))
        tokens.update(more)
        errors.update(more_errors)
    return tokens, errors, accepted


def count_verification(perf, speculator: Optional["Speculator"], drafts: Sequence[int], emitted: Sequence[int]) -> None:
    """One verification of ``drafts`` that emitted ``emitted`` (accepted drafts + one target token), counted in the
    request's ``perf`` and in the executor's ``speculator`` (None: the drafts came with the request, as
    ``draft_input_ids``, and the executor has no drafter of its own)."""
    perf.total_draft_tokens += len(drafts)
    perf.total_accepted_draft_tokens += len(emitted) - 1
    if speculator is not None:
        speculator.record(drafts, emitted)


@dataclass
class _DraftState:
    table: list[int] = field(default_factory=list)
    cached: int = 0  # positions of the request's sequence whose draft KV is valid


class DraftModel:
    """A draft model with its own paged KV (same block size as the target's) and per-request block tables."""

    def __init__(self, engine, num_blocks: int, tokens_per_block: int):
        self.engine = engine  # a ReferenceEngine over the draft model
        self.pool = BlockPool(num_blocks, tokens_per_block)
        engine.allocate(num_blocks, tokens_per_block)
        self.state: dict[int, _DraftState] = {}

    def forget(self, request_id: int) -> None:
        st = self.state.pop(request_id, None)
        if st is not None and st.table:
            self.pool.release(st.table)

    def propose(self, requests: list, ks: dict[int, int]) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        """k drafts per request (and the distributions they were drawn from, None when greedy), all requests packed
        in each of the k draft forwards."""
        drafts = {r.id: [] for r in requests}
        probs = {r.id: [] for r in requests}
        entries = []
        for r in requests:
            st = self.state.setdefault(r.id, _DraftState())
            self.pool.grow(st.table, len(r.tokens) + ks[r.id])
            entries.append(StepEntry(r.id, r.tokens[st.cached :], st.cached, st.table, True, True))
            st.cached = len(r.tokens)
        by_id = {r.id: r for r in requests}
        for step in range(max(ks.values())):
            logits = self.engine.logits(StepBatch(-1, entries))
            nxt = []
            for e, row in zip(entries, logits):
                r = by_id[e.request_id]
                s = r.request.sampling
                if s.greedy:
                    tok = int(row.argmax())
                else:
                    q = sampling_probs(row, s)
                    tok = draw(q, r.generator)
                    probs[r.id].append(q)
                drafts[r.id].append(tok)
                if len(drafts[r.id]) < ks[r.id]:
                    st = self.state[r.id]
                    nxt.append(StepEntry(r.id, [tok], len(r.tokens) + step, st.table, False, True))
            entries = nxt
            if not entries:
                break
        for r in requests:  # the draft KV now holds tokens and d1..d(k-1)
            self.state[r.id].cached = len(r.tokens) + ks[r.id] - 1
        return {i: (drafts[i], torch.stack(probs[i]) if probs[i] else None) for i in drafts}

    def accepted(self, request_id: int, valid: int) -> None:
        """After verification: the draft KV is valid for the first ``valid`` positions only."""
        st = self.state.get(request_id)
        if st is not None:
            st.cached = min(st.cached, valid)


class Speculator:
    """The executor's speculation: which requests draft how many tokens, the drafts, and the acceptance counters."""

    def __init__(self, config: ExecutorConfig, draft_engine=None, target_engine=None, pool: Optional[BlockPool] = None):
        """``draft_engine``: the draft model's step engine (DraftTarget) or the head (MTP, Eagle3) of
        :func:`trtpipe.serving.reference_engine.draft_engine`; ``target_engine``: the executor's own (the heads read
        its hidden states); ``pool``: the executor's block pool (a head's KV is extra layers of it)."""
        kind = config.speculative_decoding_type
        if kind not in DECODING_TYPES:
            raise ValueError(f"speculative decoding_type {kind!r}: the twin executes {', '.join(DECODING_TYPES)}")
        if kind in (DRAFT_TARGET, *HIDDEN_STATE_TYPES) and draft_engine is None:
            raise ValueError(f"speculative decoding_type {kind} needs a draft model or head (speculative_model)")
        self.config = config
        self.k = config.max_draft_len
        extra = config.max_batch_size * (-(-(self.k + 1) // config.tokens_per_block) + 1)
        blocks = config.num_blocks + extra
        self.draft = None
        if kind == DRAFT_TARGET:
            self.draft = DraftModel(draft_engine, blocks, config.tokens_per_block)
        elif kind == LOOKAHEAD:  # the window, pool and verification set of trtpipe.serving.lookahead
            from trtpipe.serving.lookahead import LookaheadDrafter

            self.draft = LookaheadDrafter(config)
        elif kind in HIDDEN_STATE_TYPES:  # trtpipe.serving.hidden_draft.HiddenDrafter over the target's engine
            pool = pool or BlockPool(config.num_blocks, config.tokens_per_block, config.enable_kv_cache_reuse)
            self.draft = draft_engine.drafter(target_engine, pool)
        self.total_draft_tokens = 0
        self.total_accepted_draft_tokens = 0
        self.verifications = 0  # target forwards that verified drafts (one per request per step)

    def draft_len(self, r) -> int:
        """Drafts this request may take now: none past its last allowed token or max_seq_len."""
        room = min(r.max_new_tokens - len(r.output), self.config.max_seq_len - len(r.tokens)) - 1
        return max(0, min(self.k, room))

    def propose(self, requests: list) -> dict[int, tuple[list[int], Optional[torch.Tensor]]]:
        ks = {r.id: self.draft_len(r) for r in requests}
        live = [r for r in requests if ks[r.id] > 0]
        if not live:
            return {}
        if self.draft is None:
            out = {}
            for r in live:
                d = ngram_draft(r.tokens, ks[r.id], self.config.max_matching_ngram_size)
                if d:
                    out[r.id] = (d, None)
            return out
        return self.draft.propose(live, ks)

    def record(self, drafts: Sequence[int], emitted: Sequence[int]) -> None:
        """Count one verification of ``drafts`` that emitted ``emitted`` (accepted drafts + one target token)."""
        accepted = len(emitted) - 1
        self.total_draft_tokens += len(drafts)
        self.total_accepted_draft_tokens += accepted
        self.verifications += 1

    def stepped(self, batch: StepBatch, result=None) -> None:
        """After every target step (a head keeps the step's hidden states; lookahead reads every row's token)."""
        if isinstance(self.draft, DraftModel) or self.draft is None:
            return
        if self.config.speculative_decoding_type == LOOKAHEAD:
            self.draft.stepped(batch, result)
            return
        self.draft.stepped(batch)

    def kept(self, request_id: int, start_pos: int, accepted: list[int]) -> None:
        """A masked verification kept drafts ``accepted`` (indices into its tokens at ``start_pos``): a head that
        keeps per-position hidden states reorders them as the KV was (:func:`~trtpipe.serving.tree_verify.kept_rows`)."""
        if self.draft is not None and hasattr(self.draft, "kept"):
            self.draft.kept(request_id, start_pos, accepted)

    def synced(self, r) -> None:
        """The request's sequence after acceptance: the draft KV stays valid up to the last shared position."""
        if self.draft is not None:
            self.draft.accepted(r.id, len(r.tokens) - 1)

    def forget(self, request_id: int) -> None:
        if self.draft is not None:
            self.draft.forget(request_id)
