"""Token generation on a :class:`ReferenceModel` with a KV cache: greedy or sampled, stop words, streaming.

Semantics follow TensorRT-LLM's executor: the end id is not part of the output; a stop word ends the
sequence and stays in it; ``temperature == 0`` is greedy. Each sequence has its own seeded generator and
its own positions, so its tokens do not depend on what else is in the batch. Sequences advance in lockstep
so ``on_step`` sees one step of every sequence at a time: each prompt is prefilled on its own (lengths
differ), then every decode step runs all unfinished sequences as one [B, 1] forward pass over a
:class:`BatchKVCache` (per-row positions, rope and masks), which is what makes a batch faster than its parts.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from trtpipe.runtime.model import BatchKVCache, KVCache, ReferenceModel

MIN_TEMPERATURE = 1e-5  # TensorRT-LLM's floor under the divisor (sampling_utils.py: max(temperature, 1e-5))


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> int:
    """One token from float32 logits [V]: greedy at temperature 0, top_k 1 or top_p 0, else top-k then top-p
    (nucleus) sampling.

    As TensorRT-LLM's torch sampler does (``_torch/pyexecutor/sampling_utils.py`` @053c42c,
    ``resolve_sampling_strategy`` and ``top_k_top_p_sampling_batch``): top_p 0 is greedy, the temperature divides
    no less than 1e-5 (a tinier one would overflow the logits to inf), and top-p always keeps the top token (a
    top_p that rounds to 0 in float32 would otherwise keep none: NaN probabilities).
    """
    logits = logits.float().cpu()  # sampling on the CPU: seeded generators give the same draws everywhere
    if temperature <= 0.0 or top_k == 1 or top_p <= 0.0:
        return int(logits.argmax())
    logits = logits / max(temperature, MIN_TEMPERATURE)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p  # keep the smallest prefix whose mass reaches top_p
        keep[0] = True  # the top token always stays, however small top_p is
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))


def per_sequence(value, n: int, nested_depth: int) -> list:
    """Broadcast a scalar/shared argument to one entry per sequence (``end_ids`` at depth 0, ``stop_words`` at 1);
    the MPI step engine reads its arguments the same way."""
    if value is None:
        return [None] * n
    if nested_depth == 0:
        return list(value) if isinstance(value, (list, tuple)) else [value] * n
    # stop words: list[list[int]] shared, or list[list[list[int]]] per sequence
    if value and value[0] and isinstance(value[0][0], (list, tuple)):
        return list(value)
    return [value] * n


def _hits_stop(tokens: list[int], stop_words: Optional[Sequence[Sequence[int]]]) -> bool:
    return bool(stop_words) and any(w and tokens[-len(w) :] == list(w) for w in stop_words)


def accept_step(
    tokens: dict, outputs: list, done: list, new: list, ends: list, stops: list, max_new_tokens: int
) -> None:
    """One step's sampled token per sequence: an end id ends it (not kept), a stop word ends it (kept), or length."""
    for i, tok in tokens.items():
        if ends[i] is not None and tok == ends[i]:
            done[i] = True
            continue
        outputs[i].append(tok)
        new[i] = [tok]
        if len(outputs[i]) >= max_new_tokens or _hits_stop(outputs[i], stops[i]):
            done[i] = True


@torch.no_grad()
def generate(
    model: ReferenceModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    end_ids=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    stop_words=None,
    on_step: Optional[Callable[[list], None]] = None,
    batched: bool = True,
) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` new tokens for each prompt.

    Args:
        prompts: token ids per sequence (lengths may differ).
        end_ids: one end id for all, one per sequence, or None.
        seed: sampling seed (sequence i uses seed + i); None draws from torch's global generator.
        stop_words: token sequences that end generation (shared, or one list per sequence).
        on_step: called after each decode step with, per sequence, ``[new_token]`` or None once finished.
        batched: decode the unfinished sequences as one [B, 1] forward per step; False runs each sequence's
            forward on its own (the per-sequence path, kept to check and time the batched one against).
    Returns:
        The new tokens of each sequence (no prompt, no end id).
    """
    n = len(prompts)
    ends, stops = per_sequence(end_ids, n, 0), per_sequence(stop_words, n, 1)
    gens = [None if seed is None else torch.Generator().manual_seed(int(seed) + i) for i in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    done = [max_new_tokens <= 0 or not p for p in prompts]
    device = model.embedding.device
    caches = [KVCache() for _ in range(n)]
    batch: Optional[BatchKVCache] = None  # the decode cache once batched decoding starts
    in_batch: list[int] = []  # sequence of each row of `batch`
    lengths = [len(p) for p in prompts]  # tokens in each sequence's cache once prefilled = next position
    max_len = max(lengths, default=0) + max(0, max_new_tokens)
    for step in range(max(0, max_new_tokens)):
        rows = [i for i in range(n) if not done[i]]
        if not rows:
            break
        if step == 0:  # prefill, one sequence at a time (prompts differ in length)
            logits = [model(torch.tensor([prompts[i]], device=device), caches[i], 0)[0, -1] for i in rows]  # [V] each
        elif batched:
            if batch is None:
                batch, caches = BatchKVCache.from_caches([caches[i] for i in rows], max_len), None
            elif rows != in_batch:  # some finished: drop their rows
                batch.keep(torch.tensor([in_batch.index(i) for i in rows], device=device))
            in_batch = rows
            ids = torch.tensor([[outputs[i][-1]] for i in rows], device=device)  # [B, 1]
            start = torch.tensor([lengths[i] for i in rows], device=device)  # [B]
            logits = model(ids, batch, start)[:, -1]  # [B, V]
            for i in rows:
                lengths[i] += 1
        else:
            logits = []
            for i in rows:
                ids = torch.tensor([[outputs[i][-1]]], device=device)  # [1, 1]
                logits.append(model(ids, caches[i], lengths[i])[0, -1])  # [V]
                lengths[i] += 1
        new: list = [None] * n
        tokens = {i: sample(row_logits, temperature, top_k, top_p, gens[i]) for i, row_logits in zip(rows, logits)}
        accept_step(tokens, outputs, done, new, ends, stops, max_new_tokens)
        if on_step is not None:
            on_step(new)
    return outputs
