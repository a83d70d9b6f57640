"""Greedy exactness against transformers in float64, with near-ties judged by the float32 error itself.

Two float32 computations of the same logits (packed vs alone, different kernels) may order two candidates
differently only when their float64 margin is within float32's own error on this model. That error is measured
(float32 reference runtime vs float64 transformers on the same tokens), so the bound is derived, not fitted.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_f64(hf, prompt: list[int], n: int, end_id=None) -> tuple[list[int], torch.Tensor]:
    """transformers float64 greedy continuation (end id not included) and the float64 logits at each step."""
    ids, out, steps = list(prompt), [], []
    for _ in range(n):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        steps.append(logits)
        tok = int(logits.argmax())
        if end_id is not None and tok == end_id:
            break
        out.append(tok)
        ids.append(tok)
    return out, torch.stack(steps) if steps else torch.empty(0)


@torch.no_grad()
def float32_error(model, hf, tokens: list[int]) -> float:
    """max |logits_f32 - logits_f64| of the reference runtime on this sequence."""
    f32 = model(torch.tensor([tokens]))[0].double()
    f64 = hf(torch.tensor([tokens])).logits[0]
    return float((f32 - f64).abs().max())


def check_greedy(model, hf, prompt: list[int], got: list[int], n: int, end_id=None) -> str:
    """'' when ``got`` is transformers' greedy output, or differs only after a genuine near-tie; else why not."""
    ref, logits = greedy_f64(hf, prompt, n, end_id)
    if got == ref:
        return ""
    i = next((k for k in range(min(len(got), len(ref))) if got[k] != ref[k]), min(len(got), len(ref)))
    if i >= len(logits):
        return f"lengths differ: got {len(got)} tokens, transformers {len(ref)}"
    bound = 4 * float32_error(model, hf, list(prompt) + ref[: i + 1])
    top2 = logits[i].topk(2).values
    margin = float(top2[0] - top2[1])
    if margin <= bound:
        return ""  # a tie within float32's error: either order is a correct float32 answer
    return f"token {i} differs (got {got[i : i + 3]}, transformers {ref[i : i + 3]}), margin {margin:.3g} > bound {bound:.3g}"


def small_config(**kw):
    """The executor limits the stories260k executor tests share (8 requests, 64-token steps, 64 blocks of 8),
    with ``kw`` replacing any of them."""
    from trtpipe.serving.api import ExecutorConfig

    base = dict(
        max_batch_size=8, max_num_tokens=64, max_input_len=96, max_seq_len=128, num_blocks=64, tokens_per_block=8
    )
    return ExecutorConfig(**{**base, **kw})
