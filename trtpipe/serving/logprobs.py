"""Log-probabilities in the sampling step: the chosen token's, the top k, and the prompt's (only when asked).

Which distribution: the model's raw logits, log-softmaxed in float32, before anything the sampler does to them
(temperature, top-k/top-p, the end id a ``min_tokens`` request may not yet choose). That is TensorRT-LLM's default
(``LogprobMode.RAW``: the torch sampler computes ``need_raw_logprobs`` for a request whose ``py_logprobs_mode`` is
RAW, the mode a request gets unless it asks for PROCESSED -- ``tensorrt_llm/_torch/pyexecutor/sampler.py``,
``_group_requests_by_strategy_key``, 2026 main; which commit first made RAW the default was not confirmed) and
vLLM's (``logprobs_mode="raw_logprobs"``). So the logprob of a token does not depend on the request's sampling
settings, and a greedy request's chosen token always has the largest logprob.

Prompt logprobs come from the prefill's logits: the logits at prompt position ``p`` give the logprob of the
prompt token at ``p + 1`` (the first prompt token has none). Only the rows of requests that ask are put through
the LM head and log-softmax, and each row is reduced to its few numbers at once, so memory stays at one
``[rows, vocab]`` block per step.

Pure (torch only), shared by every step engine: the engine calls :func:`rows_of` to learn which packed positions
need logits and :func:`split_rows` to turn those logits into sampling rows and logprob records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MAX_LOGPROBS = 20  # top-k logprobs per token a request may ask for (OpenAI's top_logprobs limit, vLLM's default)


@dataclass(frozen=True)
class TokenLogprob:
    """One position: ``logprob`` of ``token`` (the chosen or the prompt token), and the ``top`` k (token, logprob)
    pairs of the same distribution, largest first (empty when k is 0)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits, targets, k: int) -> list[TokenLogprob]:
    """``TokenLogprob`` per row of float logits ``[R, V]`` for ``targets`` (R token ids), with the top ``k``.

    The log-softmax runs in float32 over the raw logits (see the module docstring); the values are rounded to
    Python floats at once, so nothing of size V outlives the call.
    """
    import torch

    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.as_tensor(list(targets), dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, idx)[:, 0].tolist()
    tops: list[tuple] = [()] * lp.shape[0]
    if k > 0:
        vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(targets, chosen, tops)]


def rows_of(batch) -> tuple[list[int], list[int], dict[int, tuple[int, int]]]:
    """Which packed positions of ``batch`` need logits.

    Returns:
        ``rows`` (packed indices, in order), ``sample_at`` (for each entry that samples, in entry order, the index
        into ``rows`` of its sampling row) and ``prompt_at`` (request id -> (first, count) into ``rows``: the
        positions whose logits score the entry's ``prompt_targets``).
    """
    rows: list[int] = []
    sample_at: list[int] = []
    prompt_at: dict[int, tuple[int, int]] = {}
    t = 0
    for e in batch.entries:
        n = len(e.tokens)
        targets = e.prompt_targets
        if e.is_context and targets:
            first = len(rows)
            rows += range(t, t + len(targets))
            prompt_at[e.request_id] = (first, len(targets))
        if e.sample and e.verifies_drafts:  # a token and its k drafts (trtpipe.serving.speculative): the last k + 1
            m = e.sample_rows
            sample_at += range(len(rows), len(rows) + m)
            rows += range(t + n - m, t + n)
        elif e.sample:
            last = t + n - 1
            if rows and rows[-1] == last:
                sample_at.append(len(rows) - 1)
            else:
                sample_at.append(len(rows))
                rows.append(last)
        t += n
    return rows, sample_at, prompt_at


def split_rows(batch, logits, sample_at, prompt_at) -> tuple:
    """(sampling logits ``[S, V]`` in sampling-entry order, {request id: prompt ``TokenLogprob`` list})."""
    prompt = {}
    for e in batch.entries:
        at = prompt_at.get(e.request_id)
        if at is not None:
            first, count = at
            prompt[e.request_id] = logprobs_of(logits[first : first + count], e.prompt_targets, e.prompt_logprobs or 0)
    return logits[sample_at], prompt


def chosen_logprobs(batch, logits, tokens: dict) -> dict[int, TokenLogprob]:
    """The chosen token's ``TokenLogprob`` for every sampling entry that asks (``logprobs`` not None); ``logits``
    are the raw sampling rows, in sampling-entry order."""
    out, i = {}, 0
    for e in batch.entries:
        if not e.sample:
            continue
        k: Optional[int] = e.logprobs
        if k is not None and e.request_id in tokens:
            out[e.request_id] = logprobs_of(logits[i : i + 1], [tokens[e.request_id]], k)[0]
        i += e.sample_rows  # an entry verifying drafts has k + 1 rows
    return out


def ban_tokens(batch, logits) -> None:
    """Set the logit of each sampling entry's ``banned`` token to -inf in place (``min_tokens``: the end id may not
    be chosen yet, as TensorRT-LLM's ``minLength`` bans it); ``logits`` are the sampling rows, in entry order."""
    rows = [e for e in batch.entries if e.sample]
    for i, e in enumerate(rows):
        banned = e.banned
        if banned is not None and 0 <= banned < logits.shape[-1]:
            logits[i, banned] = float("-inf")
