"""What the CPU twin of TensorRT-LLM's Triton ``llmapi`` model needs from the library: ``text_input`` and the
``sampling_param_*`` inputs to an executor request, the final response to ``text_output`` and the perf outputs.

Semantics are upstream's model (``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d2``): one prompt
per request, generated text only (``RequestOutput.outputs[0].text``), ``finish_reason`` / ``stop_reason`` /
``cumulative_logprob`` on request, and with ``sampling_param_return_perf_metrics`` the request's KV, timing and
speculative-decoding metrics (``acceptance_rate``, ``total_accepted_draft_tokens``, ``total_draft_tokens``). The
twin sends them in the types the repository's config.pbtxt declares (:mod:`trtpipe.triton.llmapi_repo`); upstream's
model.py builds them with ``text_output``'s numpy type instead. The model runs on the executor the recipe configures
(the serialized :class:`~trtpipe.serving.api.ExecutorConfig` in the ``twin_executor_config`` parameter), over the
OpenAI twin's :class:`~trtpipe.serving.openai_server.ServedModel` (tokenizer, end id, draft model).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from trtpipe.serving.api import FinishReason, Request, Response, SamplingParams

Getter = Callable[[str], Optional[np.ndarray]]
DEFAULT_MAX_TOKENS = 32  # SamplingParams.max_tokens when the request sets none (tensorrt_llm/sampling_params.py)
FINISH = {FinishReason.END_ID: "stop", FinishReason.STOP_WORDS: "stop", FinishReason.LENGTH: "length"}


def scalar(get: Getter, name: str):
    a = get(name)
    if a is None or a.size == 0:
        return None
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v


def prompt_of(get: Getter) -> str:
    a = get("text_input")
    if a is None or a.size == 0:
        raise ValueError("text_input is missing from the request")
    if a.size > 1:
        raise ValueError("text_input: one prompt per request (a 1-element tensor)")
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def request_of(
    get: Getter, prompt_ids: list[int], end_id: Optional[int], streaming: bool, stop_ids: Sequence[int] = ()
) -> Request:
    """The executor request of one llmapi request (greedy unless a temperature > 0 is sent); ``stop_ids``: the
    model's other end tokens (:meth:`trtpipe.serving.end_tokens.EndTokens.for_request`). A bad sampling value is a
    ValueError naming it."""
    temp = scalar(get, "sampling_param_temperature")
    top_k, top_p, seed = (scalar(get, f"sampling_param_{n}") for n in ("top_k", "top_p", "seed"))
    max_tokens = scalar(get, "sampling_param_max_tokens")
    sampling = SamplingParams(  # unset: greedy, as llmapi's SamplingParams without temperature / top_k / top_p
        temperature=float(temp) if temp is not None else 0.0,
        top_k=int(top_k) if top_k is not None else 0,
        top_p=float(top_p) if top_p is not None else 1.0,
        seed=int(seed) if seed is not None else None,
    )
    problem = sampling.problem()
    if problem:
        raise ValueError(problem)
    return Request(
        list(prompt_ids),
        int(max_tokens) if max_tokens is not None else DEFAULT_MAX_TOKENS,
        end_id=end_id,
        stop_words=[[int(t)] for t in stop_ids],
        sampling=sampling,
        streaming=streaming,
        exclude_input_from_output=True,
        return_perf_metrics=bool(scalar(get, "sampling_param_return_perf_metrics")),
    )


def text_output(text: str) -> tuple[str, np.ndarray]:
    return "text_output", np.array([text.encode("utf-8")], dtype=object)


def response_outputs(resp: Response, text: str, get: Getter) -> list[tuple[str, np.ndarray]]:
    """Output tensors of a final response: ``text_output`` [1], the asked-for reasons, the perf metrics."""
    out = [text_output(text)]
    if scalar(get, "return_finish_reason"):
        out.append(("finish_reason", np.array([FINISH.get(resp.finish_reason, "").encode()], dtype=object)))
    if scalar(get, "return_stop_reason"):
        out.append(("stop_reason", np.array([b"None"], dtype=object)))
    p = resp.perf
    if p is not None:
        out += [
            (name, np.array([value], dtype))
            for name, value, dtype in (
                ("kv_cache_reused_block", p.kv_reused_blocks, np.int32),
                ("kv_cache_missed_block", p.kv_missed_blocks, np.int32),
                ("kv_cache_alloc_new_blocks", p.kv_alloc_new_blocks, np.int32),
                ("kv_cache_alloc_total_blocks", p.kv_alloc_total_blocks, np.int32),
                ("arrival_time_ns", p.arrival_ns, np.int64),
                ("first_scheduled_time_ns", p.first_scheduled_ns, np.int64),
                ("first_token_time_ns", p.first_token_ns, np.int64),
                ("last_token_time_ns", p.last_token_ns, np.int64),
                ("acceptance_rate", p.acceptance_rate, np.float32),
                ("total_accepted_draft_tokens", p.total_accepted_draft_tokens, np.int32),
                ("total_draft_tokens", p.total_draft_tokens, np.int32),
            )
        ]
    return out


def drop_stop_token(tokens: list[int], resp: Response, stop_ids: Sequence[int]) -> None:
    """A final response that ended on one of ``stop_ids`` leaves that token out of ``tokens`` (the LLM API drops a
    stop word's tokens unless ``include_stop_str_in_output``: ``GenerationResultBase._handle_sequence``,
    ``tensorrt_llm/executor/result.py``@a678b91a)."""
    if resp.is_final and resp.finish_reason == FinishReason.STOP_WORDS and tokens and tokens[-1] in stop_ids:
        tokens.pop()
