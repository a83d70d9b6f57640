"""Which ``tensorrt_llm`` inputs the CPU twin honours, and the one-line refusal for a request that needs more.

The twin declares every input the real ``tensorrtllm`` backend declares (so clients and upstream model files
see the same model), but it computes with trtpipe's reference runtime, which has no beam search, prompt
tuning, draft logits or logits outputs. A request is refused (an error
response naming the input) when it asks for one of those, and served when such an input is absent or holds the
value that means "off" -- the value the real backend would also treat as a no-op. Inputs that only tune the
real engine's KV-cache eviction (``retention_*``) change no output and are accepted and ignored.

Pure (numpy only): the twin model calls :func:`refusal` with a getter for the request's input arrays. Adding
a feature to the twin is moving its inputs from :data:`OFF_WHEN` / :data:`NEVER` to :data:`HONOURED`.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

# Computed by the twin (trtpipe/serving/triton_adapter.py over the in-flight batching executor).
HONOURED = frozenset(
    {
        "input_ids",
        "input_lengths",
        "request_output_len",
        "end_id",
        "pad_id",
        "stop_words_list",
        "bad_words_list",
        "temperature",
        "runtime_top_k",
        "runtime_top_p",
        "seed",
        "exclude_input_in_output",
        "streaming",
        "stop",
        "return_perf_metrics",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "priority",
        "guided_decoding_guide_type",  # the executor's grammar (trtpipe/serving/guided.py)
        "guided_decoding_guide",
        "return_log_probs",  # output_log_probs, cum_log_probs (trtpipe.serving.logprobs)
        "min_tokens",
        "lora_task_id",  # the engine's LoRA tasks (trtpipe/serving/triton_lora.py)
        "lora_weights",
        "lora_config",
        # drafts verified in the context step's forward (upstream's two-model draft-target form: the BLS sends the
        # draft model's tokens; trtpipe/serving/executor.py)
        "draft_input_ids",
        # the request's lookahead (W, N, G), at most the model's lookahead_* parameters (trtpipe/serving/lookahead.py)
        "lookahead_window_size",
        "lookahead_ngram_size",
        "lookahead_verification_set_size",
        "draft_logits",  # the draft's generation logits: rejection sampling (trtpipe/serving/draft_logits.py)
        "return_generation_logits",  # generation_logits: each output token's logits row
    }
)

# Accepted and ignored: no effect on any output the twin returns.
IGNORED = frozenset(
    {
        "retention_token_range_starts",
        "retention_token_range_ends",
        "retention_token_range_priorities",
        "retention_token_range_durations_ms",
        "retention_decode_priority",
        "retention_decode_duration_ms",
        # only read by the real engine together with an input the twin refuses below
        "draft_acceptance_threshold",  # with draft_logits: the twin verifies by rejection sampling, no threshold
        "prompt_vocab_size",  # prompt_embedding_table
        "runtime_top_p_min",
        "runtime_top_p_reset_ids",  # runtime_top_p_decay < 1
        "len_penalty",
        "early_stopping",
        "beam_search_diversity_rate",  # beam_width > 1
    }
)

_FALSE = ("false", lambda a: not a.astype(bool).any())


def _equal(value: float) -> tuple[str, Callable[[np.ndarray], bool]]:
    return (str(value), lambda a: bool(np.all(a.astype(np.float64) == value)))


# Served only at the value that means "off" (what the backend uses when the input is absent).
OFF_WHEN: dict[str, tuple[str, Callable[[np.ndarray], bool]]] = {
    "num_return_sequences": _equal(1),
    "beam_width": _equal(1),
    "repetition_penalty": _equal(1.0),
    "presence_penalty": _equal(0.0),
    "frequency_penalty": _equal(0.0),
    "runtime_top_p_decay": _equal(1.0),
    "return_context_logits": _FALSE,
}

# Refused whenever present with data: features the reference runtime does not have.
NEVER: dict[str, str] = {
    "embedding_bias": "embedding bias",
    "prompt_embedding_table": "prompt tuning",
    "prompt_table_extra_ids": "prompt tuning",
    "context_phase_params": "disaggregated serving",
}


def known_inputs() -> frozenset[str]:
    return HONOURED | IGNORED | frozenset(OFF_WHEN) | frozenset(NEVER)


def refusal(get: Callable[[str], Optional[np.ndarray]]) -> Optional[str]:
    """Why the twin cannot serve this request (one line naming the input), or None when it can.

    ``get(name)`` returns the request's array for an input, or None when the request does not carry it.
    """
    for name, feature in NEVER.items():
        a = get(name)
        if a is not None and a.size:
            return (
                f"{name}: {feature} is not supported by the CPU twin (trtpipe's reference runtime); "
                "serve a TensorRT engine for it"
            )
    for name, (off, is_off) in OFF_WHEN.items():
        a = get(name)
        if a is not None and a.size and not is_off(a):
            return f"{name}: the CPU twin serves only {name}={off} (trtpipe's reference runtime); got {a.reshape(-1).tolist()}"
    return None
