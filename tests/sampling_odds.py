"""How likely a sampled token sequence is, for tests that check a seed is used.

"Same seed -> same tokens" alone passes when the seed is ignored (a fixed generator repeats too). The other half,
"another seed -> other tokens", can fail by chance: another seed draws the very same sequence with probability
p(sequence) under the sampling distribution (the draws of two seeds are independent). :func:`sequence_probability`
computes that p, in float64 and written apart from the sampler (top-k, then top-p on the softmax at temperature),
so a test can assert it is negligible before it asserts the sequences differ.
"""

from __future__ import annotations

import torch

from trtpipe.runtime import KVCache


def sampling_distribution(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """float64 probabilities [V] of one sampled token: softmax(logits / temperature) over the top_k largest, then the
    smallest most-likely set whose mass reaches top_p, renormalised."""
    z = logits.double() / temperature
    if top_k > 0:
        z = torch.where(z >= torch.topk(z, top_k).values[-1], z, torch.tensor(float("-inf"), dtype=z.dtype))
    p = torch.softmax(z, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p
        keep = order[before < top_p]
        p = torch.zeros_like(p).index_put_((keep,), p[keep])
        p = p / p.sum()
    return p


@torch.no_grad()
def sequence_probability(
    model, prompt: list[int], tokens: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> float:
    """p(tokens | prompt) under the sampling distribution, from one teacher-forced forward of prompt + tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.embedding.device)
    logits = model(ids, KVCache(), 0)[0]  # [T, V]
    p = 1.0
    for k, tok in enumerate(tokens):
        p *= float(sampling_distribution(logits[len(prompt) - 1 + k], temperature, top_k, top_p)[tok])
    return p
