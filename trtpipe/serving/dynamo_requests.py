"""Dynamo's request to a token engine, as an executor :class:`~trtpipe.serving.api.Request` (pure, no Dynamo import).

The frontend sends a worker a dict (ai-dynamo 1.6.1 ``dynamo/common/backend/engine.py``, ``GenerateRequest``):
``token_ids``, ``stop_conditions`` (``max_tokens``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``),
``sampling_options`` (``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ...), ``output_options``
(``logprobs``, ...), ``eos_token_ids``. An unset field is ``None``; ``temperature`` unset is greedy, as
TensorRT-LLM's default. What the executor cannot do (``n`` > 1, beam search, ``min_tokens``, logprobs) is refused
with one line, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Optional, Union

from trtpipe.serving.api import FinishReason, Request, SamplingParams
from trtpipe.errors import ServingError
from trtpipe.serving.end_tokens import EndTokens, end_tokens, eos_ids
from trtpipe.serving.guided import Guide, GuidedDecodingParams, GuideError


class RequestRefused(ValueError):
    """A request this worker cannot serve as asked (the worker answers it with Dynamo's InvalidArgument)."""


# Dynamo's finish reasons (``GenerateChunk.finish_reason``) for the executor's.
FINISH = {
    FinishReason.END_ID: "stop",
    FinishReason.STOP_WORDS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMED_OUT: "length",
    FinishReason.CANCELLED: "cancelled",
}
UNSUPPORTED = (
    ("sampling_options", "n", (None, 1)),
    ("sampling_options", "best_of", (None, 1)),
    ("sampling_options", "use_beam_search", (None, False)),
    ("stop_conditions", "min_tokens", (None, 0)),
    ("output_options", "logprobs", (None,)),
    ("output_options", "prompt_logprobs", (None,)),
)


def request_end_tokens(eos_token_ids, model: Union[EndTokens, int, None]) -> EndTokens:
    """The end tokens of a request: every one of its ``eos_token_ids`` (the frontend's, from the model's
    generation config) ends it, as TensorRT-LLM's ``SamplingParams._setup`` makes the generation config's ids stop
    tokens (trtpipe/serving/end_tokens.py); the model's end id stays the end id when the list holds it. Without
    ``eos_token_ids``, the model's own end tokens."""
    model = model if isinstance(model, EndTokens) else EndTokens(model)
    try:
        ids = eos_ids(eos_token_ids, "eos_token_ids") if eos_token_ids else []
    except ServingError as exc:
        raise RequestRefused(str(exc)) from None
    if not ids:
        return model
    return end_tokens(ids, model.end_id if model.end_id in ids else None)


def translate(request: dict, eos_id: Union[EndTokens, int, None], max_seq_len: int) -> Request:
    """A Dynamo ``GenerateRequest`` as an executor :class:`Request`; what the executor cannot honour is refused."""
    prompt = list(request.get("token_ids") or [])
    if not prompt:
        raise RequestRefused("the request has no prompt tokens")
    for group, key, allowed in UNSUPPORTED:
        value = (request.get(group) or {}).get(key)
        if value not in allowed:
            raise RequestRefused(f"{key}={value!r} is not supported by this worker (allowed: {allowed[-1]!r})")
    stop = request.get("stop_conditions") or {}
    opts = request.get("sampling_options") or {}
    room = max_seq_len - len(prompt)
    if room < 1:
        raise RequestRefused(f"the prompt has {len(prompt)} tokens; this worker's max_seq_len is {max_seq_len}")
    max_new = stop.get("max_tokens")
    max_new = room if max_new is None else int(max_new)
    if not 1 <= max_new <= room:
        raise RequestRefused(f"max_tokens must be in [1, {room}] for a {len(prompt)}-token prompt, got {max_new}")
    end_id, stop_ids = request_end_tokens(request.get("eos_token_ids"), eos_id).for_request(
        bool(stop.get("ignore_eos")), stop.get("stop_token_ids") or ()
    )
    temperature = opts.get("temperature")
    sampling = SamplingParams(
        temperature=0.0 if temperature is None else float(temperature),
        top_k=int(opts.get("top_k") or 0),
        top_p=float(opts.get("top_p") or 1.0),
        seed=opts.get("seed"),
    )
    problem = sampling.problem()
    if problem:
        raise RequestRefused(problem)
    guide = guided_decoding(opts.get("guided_decoding"))
    return Request(
        prompt=prompt,
        max_new_tokens=max_new,
        end_id=end_id,
        stop_words=[[t] for t in stop_ids],
        sampling=sampling,
        streaming=True,
        exclude_input_from_output=True,
        guide=guide,
    )


def guided_decoding(options: Optional[dict]) -> Optional[Guide]:
    """Dynamo's ``sampling_options.guided_decoding`` as the executor's guide (trtpipe.serving.guided).

    ``GuidedDecodingOptions`` (ai-dynamo/dynamo ``lib/llm/src/protocols/common.rs``@0ab24416) holds one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``structural_tag``, with the modifiers ``backend`` and ``whitespace_pattern``;
    they are read as the LLM API's GuidedDecodingParams reads the same fields. ``choice`` and ``whitespace_pattern``,
    which TensorRT-LLM's GuidedDecodingParams has no field for, are refused; ``backend`` is the worker's own."""
    if not options:
        return None
    for key in ("choice", "whitespace_pattern"):  # an empty choice list is unset, as Dynamo's from_optional reads it
        if options.get(key) not in (None, []):
            raise RequestRefused(f"guided_decoding.{key} is not supported by this worker (TensorRT-LLM has no {key})")
    tag = options.get("structural_tag")
    try:
        return GuidedDecodingParams(
            json=options.get("json"),
            regex=options.get("regex"),
            grammar=options.get("grammar"),
            structural_tag=tag if tag is None or isinstance(tag, str) else json.dumps(tag),
        ).guide()
    except GuideError as exc:
        raise RequestRefused(f"guided_decoding: {exc}") from None
