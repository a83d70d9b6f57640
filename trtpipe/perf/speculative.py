"""Speculative decoding in the cost model: the speed-up of one decode step given an acceptance length.

A speculative step of a batch of B generating requests at KV length L, k = ``max_draft_len``:
- **draft**: k sequential forwards of the drafter at batch B (n-gram: none, it runs on the host or in one kernel;
  a draft model: its own deployment; an EAGLE-3 head or an MTP module: one target-shaped decoder layer and the
  (draft) vocabulary's lm_head, :func:`head_spec`). Medusa has no draft forwards: its heads run inside the
  verification forward, on the hidden states of all its B x (k + 1) positions (``GenericMedusaForCausalLM.forward``
  stacks ``medusa_logits`` [num_medusa_heads, batch, num_medusa_tokens + 1, vocab] after the base model's forward,
  ``tensorrt_llm/models/medusa/model.py@02499765``), and the next step's drafts are their top-k at the accepted
  path (:func:`medusa_terms` adds their weights and GEMMs to the verification);
- **verification**: one target forward of B x (k + 1) tokens: the weights are read once, the GEMMs and attention
  FLOPs are those of B chunks of k + 1 tokens starting at L, and the KV cache is read once per request as in a
  plain decode step (the k + 1 queries of a request share one pass over its cache);
- **acceptance length** (AL): tokens a request gains per verification, the accepted drafts plus the target's own
  token (1 <= AL <= k + 1; TensorRT-LLM's "accepted length", ``docs/source/blogs/tech_blog/
  blog7_NGram_performance_Analysis_And_Auto_Enablement.md@7274a594``: "if w out of the v draft tokens are accepted,
  the accepted length (AL) will be w+1").

Time per output token is (draft + verification) / AL against a plain step's time, so the decode speed-up is
AL x plain / (draft + verification). Prefill is unchanged. This is a steady-state step model: a batch whose
requests accept different lengths, and a scheduler that admits by the longer sequences, are not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from trtpipe.errors import TrtpipeError
from trtpipe.perf.cost import GB, TERA, Constants, Deployment, Terms, group_terms, step_time
from trtpipe.perf.models import ModelSpec

NO_DRAFT_COST = frozenset({"NGram", "lookahead_decoding"})  # drafts from the sequence itself
HEAD_DRAFTS = frozenset({"Eagle3", "eagle", "MTP"})  # one decoder layer (+ lm_head) per draft token
IN_VERIFY_HEADS = frozenset({"medusa", "Medusa"})  # heads computed inside the verification forward
HEAD_BYTES = 2  # Medusa heads are loaded in float16 (load_medusa_hf(dtype="float16"), model.py@02499765)


@dataclass(frozen=True)
class SpeculativeStep:
    batch: int
    kv_len: int
    max_draft_len: int
    acceptance_length: float
    plain_s: float  # one decode step without speculation
    verify_s: float  # one target forward of batch x (k + 1) tokens
    draft_s: float  # the k draft forwards

    @property
    def itl_s(self) -> float:
        return (self.verify_s + self.draft_s) / self.acceptance_length

    @property
    def speedup(self) -> float:
        """Decode tokens/s with speculation over without (and the plain ITL over the speculative one)."""
        return self.plain_s / self.itl_s


def head_spec(target: ModelSpec, vocab: Optional[int] = None, layers: int = 1) -> ModelSpec:
    """An EAGLE-3 head or an MTP module as the cost model sees it: ``layers`` decoder layers shaped as the target's
    last kind (MTP: DeepSeek's MoE layer) and an lm_head over ``vocab`` (EAGLE-3's draft vocabulary; default the
    target's). The EAGLE-3 head's fc over three captured hidden states (3 x hidden x hidden) is not counted."""
    kind = replace(target.layers[-1], count=layers)
    return replace(target, name=f"{target.name} draft head", layers=(kind,), vocab=vocab or target.vocab)


def _check(acceptance_length: float, k: int) -> None:
    if not 1.0 <= acceptance_length <= k + 1:
        raise TrtpipeError(
            f"acceptance length {acceptance_length:g} is outside [1, max_draft_len + 1 = {k + 1}]: it counts the "
            "accepted drafts plus the target's own token per verification"
        )


def verify_terms(d: Deployment, batch: int, kv_len: int, k: int) -> Terms:
    """One verification forward: ``batch`` chunks of k + 1 tokens at ``kv_len`` (their GEMMs, attention FLOPs and
    k + 1 sampled rows each), reading each request's KV cache once as a plain decode step does."""
    chunks = group_terms(d, [(kv_len, k + 1, batch)], [], batch * (k + 1))
    return replace(chunks, kv=group_terms(d, [], [(kv_len, batch)], batch).kv)


def medusa_terms(d: Deployment, tokens: float, num_heads: int, num_layers: int = 1) -> Terms:
    """Medusa's heads inside a verification of ``tokens`` positions: each head's ``num_layers`` residual blocks
    (hidden x hidden + bias) and its lm_head (hidden x vocab), 16-bit, split over the tp ranks (``ColumnLinear``
    with ``gather_output``): their weights read once, their GEMMs over every position. The logits' all-gather is not
    counted."""
    m, g = d.model, d.gpu
    params = num_heads * (num_layers * (m.hidden * m.hidden + m.hidden) + m.hidden * m.vocab) / d.tp
    return Terms(
        mem=params * HEAD_BYTES / (g.bandwidth_gbs * GB),
        kv=0.0,
        gemm=2 * tokens * params / (g.tflops_16 * TERA),
        attn=0.0,
        comm=0.0,
        seqs=0.0,
        layers=0.0,
    )


def speculative_step(
    d: Deployment,
    c: Constants,
    batch: int,
    kv_len: int,
    max_draft_len: int,
    acceptance_length: float,
    draft: Optional[Deployment] = None,
    medusa_heads: int = 0,
    medusa_layers: int = 1,
    draft_forwards: Optional[int] = None,
) -> SpeculativeStep:
    """The plain, verification and draft times of one step (``draft`` None: drafts cost nothing, as n-gram's;
    ``medusa_heads`` > 0: that many Medusa heads of ``medusa_layers`` blocks run inside the verification).
    ``draft_forwards``: the drafter's sequential forwards per step (default k, one per draft; an EAGLE tree runs one
    EagleNet per level, its depth: the extra tokens of a level's forward are not costed)."""
    _check(acceptance_length, max_draft_len)
    k = max_draft_len
    plain = group_terms(d, [], [(kv_len, batch)], batch)
    verify = verify_terms(d, batch, kv_len, k)
    if medusa_heads:
        verify = verify + medusa_terms(d, batch * (k + 1), medusa_heads, medusa_layers)
    draft_s = 0.0
    if draft is not None:
        one = group_terms(draft, [], [(kv_len, batch)], batch)
        draft_s = (k if draft_forwards is None else draft_forwards) * float(step_time(one, c))
    return SpeculativeStep(
        batch, kv_len, k, acceptance_length, float(step_time(plain, c)), float(step_time(verify, c)), draft_s
    )


def draft_deployment(
    target: Deployment, decoding_type: str, draft_model: Optional[ModelSpec] = None, draft_vocab: Optional[int] = None
) -> Optional[Deployment]:
    """The drafter's deployment beside ``target`` (same GPUs, tp and precision, one pipeline stage): None for
    n-gram / lookahead and Medusa (its heads run in the verification: :func:`medusa_terms`), a head for EAGLE/MTP,
    ``draft_model`` for a draft-target pair."""
    if decoding_type in NO_DRAFT_COST or decoding_type in IN_VERIFY_HEADS:
        return None
    if decoding_type in HEAD_DRAFTS:
        spec = head_spec(target.model, vocab=draft_vocab)
    elif draft_model is not None:
        spec = draft_model
    else:
        raise TrtpipeError(f"decoding_type {decoding_type}: the draft model's config is needed to cost its forwards")
    return replace(target, model=spec, pp=1, ep=1 if not spec.is_moe else target.ep)
