"""Validation of one request to the ``tensorrt_llm`` model (CPU twin), before it joins a batch.

Why here and not in the model file: a request that reaches the batch with an id outside the vocabulary or a
NaN temperature makes the whole batched forward fail, so every request of that batch would get its error.
Each check raises ``ValueError`` with one line naming the input; the model turns it into that request's
error response and keeps serving. Found by ``tests/tools/fuzz_serving.py``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from trtpipe.serving.api import sampling_problem


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str = "input_ids") -> None:
    """Every id in [0, vocab_size)."""
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}[{i}] = {int(ids.reshape(-1)[i])} is outside the vocabulary [0, {vocab_size})")


def check_sampling(temperature: float, top_k: int, top_p: float, seed: Optional[int]) -> None:
    """Finite, in-range sampling settings (TensorRT-LLM's SamplingConfig ranges), named as the Triton inputs."""
    problem = sampling_problem(
        temperature, top_k, top_p, seed, ("temperature", "runtime_top_k", "runtime_top_p", "seed")
    )
    if problem:
        raise ValueError(problem)


def word_lists(array: Optional[np.ndarray], name: str, vocab_size: int) -> list[list[int]]:
    """``[1, 2, L]`` (ids row, cumulative end offsets padded with -1) -> token-id lists, checked.

    Offsets must increase, stay within the L ids, and be followed only by -1; ids must be in the vocabulary.
    """
    if array is None or array.size == 0:
        return []
    if array.ndim < 2 or array.shape[-2] != 2 or array.size // (2 * array.shape[-1]) != 1:
        raise ValueError(f"{name} must have shape [1, 2, L] (ids, offsets), got {list(array.shape)}")
    ids, offsets = array.reshape(2, array.shape[-1])
    words, start = [], 0
    for k, end in enumerate(int(x) for x in offsets):
        if end < 0:
            if any(int(x) >= 0 for x in offsets[k:]):
                raise ValueError(f"{name}: offset {k} is -1 but a later offset is not (-1 only pads the end)")
            break
        if not start < end <= ids.size:
            raise ValueError(f"{name}: offset {k} = {end} must be > {start} and <= {ids.size} (offsets increase)")
        words.append([int(x) for x in ids[start:end]])
        start = end
    used = np.array([t for w in words for t in w], dtype=np.int64)
    check_token_ids(used, vocab_size, f"{name} ids")
    return words


def longest_token_chars(vocab) -> int:
    """Characters of the longest vocabulary entry (at least 1): no token spans more of a text than that."""
    return max((len(t) for t in vocab), default=1) or 1


def refuse_untokenized(n_chars: int, longest: int, room: int, where: str) -> None:
    """ValueError when a text of ``n_chars`` characters cannot fit ``room`` tokens whatever it tokenizes to: it
    makes at least ``ceil(n_chars / longest)`` tokens (``longest``: :func:`longest_token_chars`). Checked before
    tokenizing, which for a 4 MB prompt costs gigabytes and seconds, only to be refused after (issue 38 item 4;
    the OpenAI twin and the Triton preprocessing model)."""
    k = max(1, longest)
    least = -(-n_chars // k)
    if least > room:
        raise ValueError(
            f"the prompt ({n_chars} characters, so at least {least} tokens: this tokenizer's longest token "
            f"has {k} characters) {where}"
        )
