"""Draft logits: the two-model form's drafts verified by rejection sampling against the distribution they were drawn
from, and the generation logits that carry that distribution from the draft model to the target.

Upstream (tensorrtllm_backend ``all_models/inflight_batcher_llm``): a BLS request with ``use_draft_logits`` true asks
the draft model for its ``generation_logits`` and sends them to the target as ``draft_logits`` beside
``draft_input_ids`` (``tensorrt_llm_bls/1/lib/decode.py``, ``Decoder._spec_generate``); ``tensorrt_llm``'s
``config.pbtxt`` declares ``draft_logits`` optional, ``${logits_datatype}``, dims ``[-1, -1]`` (draft tokens x vocab).
The citations, at the commits read, are in docs/reference/speculative.md.

In the twin the target turns the ``[k, V]`` draft logits into the draft's sampling distribution q with the request's
own sampling settings (the BLS gives draft and target the same ones), and :func:`trtpipe.serving.speculative.verify`
keeps draft i with probability min(1, p_i(d) / q_i(d)) and otherwise draws from the residual (p - q)+: the output is
distributed as the target's alone. Greedy requests ignore them (a draft is kept when it is the target's argmax).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from trtpipe.serving.api import Request, StepBatch
from trtpipe.serving.speculative import sampling_probs


def check_draft_logits(logits: np.ndarray, num_drafts: int, vocab: int) -> np.ndarray:
    """``draft_logits`` of a Triton request as ``[k, V]`` float32 (rows padded past the vocabulary cut); ValueError
    (one line) when its shape does not match the request's ``draft_input_ids`` or the model's vocabulary, or a value
    is not finite."""
    a = np.asarray(logits, dtype=np.float32)
    a = a.reshape(-1, a.shape[-1]) if a.ndim >= 2 else np.zeros((0, 0), np.float32)  # not rows: refused below
    if a.shape[0] != num_drafts or a.shape[1] < vocab:  # an engine's rows may be padded past the vocabulary
        raise ValueError(
            f"draft_logits has shape {tuple(np.shape(logits))}: it needs one row of {vocab} logits per draft token "
            f"({num_drafts} in draft_input_ids)"
        )
    a = a[:, :vocab]
    if not np.isfinite(a).all():  # a NaN row would make the rejection sampling's distribution undefined
        raise ValueError("draft_logits holds a NaN or infinite value: the draft's logits must be finite")
    return a


def external_draft_probs(request: Request, k: int) -> Optional[torch.Tensor]:
    """q ``[k, V]``: the distribution the first ``k`` external drafts were drawn from, or None (no draft logits, or a
    greedy request: verification is then token matching)."""
    if request.draft_logits is None or k == 0 or request.sampling.greedy:
        return None
    rows = torch.as_tensor(np.asarray(request.draft_logits, dtype=np.float32))[:k]
    return sampling_probs(rows, request.sampling)


def kept_rows(batch: StepBatch, logits: torch.Tensor, sample_at: list[int]) -> dict[int, torch.Tensor]:
    """The logits row each ``keep_logits`` entry sampled its token from (entries that verify drafts have several
    rows and keep none)."""
    out, i = {}, 0
    for e in batch.entries:
        if not e.sample:
            continue
        m = e.sample_rows
        if e.keep_logits and m == 1:
            out[e.request_id] = logits[sample_at[i]]
        i += m
    return out
