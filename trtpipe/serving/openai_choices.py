"""What an OpenAI request asks beyond one plain text: ``n`` / ``best_of`` choices, ``logprobs`` / ``top_logprobs``,
``echo``, ``ignore_eos`` / ``min_tokens``; and the ``logprobs`` objects of the answer, in OpenAI's shapes.

Pure (no aiohttp, no torch): the OpenAI twin (:mod:`trtpipe.serving.openai_server`) reads a request's
:class:`ChoiceSpec` with :func:`choice_spec` and formats the executor's :class:`~trtpipe.serving.logprobs.TokenLogprob`
records with :func:`completion_logprobs` and :func:`chat_logprobs`.

Upstream, as this twin follows it (NVIDIA/TensorRT-LLM @0076e9390e1ed11515f149eec356f5a03f4a00d8 for
``tensorrt_llm/serve/openai_protocol.py``, @a98a9061d72f6fd39f5d055ebdd2c6878a100e2c for
``tensorrt_llm/sampling_params.py``, @7b437aaa73bf5a44b1102aee5c631074da763b8f for
``tensorrt_llm/serve/postprocess_handlers.py``):

* completions ``logprobs: int`` and chat ``logprobs: bool`` + ``top_logprobs: int`` (chat asks for 1 when
  ``top_logprobs`` is 0: ``ChatCompletionRequest.to_sampling_params``); the chat entries are
  ``{token, logprob, bytes, top_logprobs}`` with the logprob floored at -9999 (``create_logprobs``);
* ``best_of`` defaults to ``n`` and may not be smaller (``SamplingParams._validate``: "best_of (B) cannot be less
  than n (N)"); greedy decoding with ``best_of`` > 1 is refused unless ``TLLM_ALLOW_N_GREEDY_DECODING`` is set
  (the same check and message); then every choice is the same greedy text;
* choice ``index`` is ``prompt_index * n + i`` (``completion_stream_post_processor``);
* ``stop_token_ids`` end the request and leave the answer unless ``include_stop_str_in_output``
  (``GenerationResultBase._handle_sequence`` in ``tensorrt_llm/executor/result.py``
  @a678b91aafbeff265cd0b764abb59d7def624ac2 drops the stop word's tokens); with it a stop string stays in the text.

Where the twin goes past what trtllm-serve answers (its completions carry no ``logprobs`` object, and ``echo``
prepends the prompt text only), it answers as OpenAI and vLLM do, because evaluation harnesses read exactly that:
completions ``choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`` with ``echo`` covering
the prompt tokens too (the first prompt token's logprob and top logprobs are ``null``), and each ``top_logprobs``
dict holding the k most likely tokens plus the chosen one. ``best_of`` > ``n`` returns the ``n`` choices with the
largest cumulative logprob (vLLM's and OpenAI's rule; that TensorRT-LLM's ``GenerationResult`` ranks the same way
was not confirmed). Each choice is its own executor request, seeded ``seed + i`` (mod 2^64) when the request has a
seed, so choices are independent samples and a seeded request repeats.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from trtpipe.serving.logprobs import MAX_LOGPROBS, TokenLogprob

MAX_SEQUENCES = 64  # executor requests one HTTP request may start (prompts x best_of): bounds one client's share
LOGPROB_FLOOR = -9999.0  # trtllm-serve's ChatCompletionLogProb default and floor (JSON has no -Infinity)
SEED_MOD = 1 << 64
WINDOW = 6  # tokens of context a token's text piece is decoded in
MAX_STOP_TOKENS = 64  # stop_token_ids per request (as the twin's MAX_STOPS for stop strings)


class SpecError(ValueError):
    """A request field out of range: the message is the 400's, ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChoiceSpec:
    n: int = 1
    best_of: int = 1
    logprobs: Optional[int] = None  # top k per output token in the answer (None: no logprobs object)
    echo: bool = False  # completions: the prompt (text and, with logprobs, its logprobs) leads each choice
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # each ends the request; left out of the answer unless include_stop
    include_stop: bool = False  # include_stop_str_in_output: the stop string or token stays in the text

    @property
    def executor_logprobs(self) -> Optional[int]:
        """What each executor request asks: the answer's k, or 0 when only best_of's ranking needs the logprobs."""
        if self.logprobs is not None:
            return self.logprobs
        return 0 if self.best_of > self.n else None


def _int(body: dict, key: str, default, lo: int, hi: Optional[int] = None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"'{key}' must be an integer", key)
    if v < lo or (hi is not None and v > hi):
        raise SpecError(f"'{key}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {str(v)[:40]}", key)
    return v


def _bool(body: dict, key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise SpecError(f"'{key}' must be a boolean", key)
    return v


def choice_spec(
    body: dict, chat: bool, greedy: bool, stream: bool, num_prompts: int = 1, vocab_size: Optional[int] = None
) -> ChoiceSpec:
    """The request's choices and logprob settings; :class:`SpecError` for a value out of range."""
    n = _int(body, "n", 1, 1)
    best_of = _int(body, "best_of", n, 1)
    if best_of < n:
        raise SpecError(f"best_of ({best_of}) cannot be less than n ({n})", "best_of")
    if best_of > 1 and greedy and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
        raise SpecError(
            f"Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got "
            f"best_of={best_of}. Please set to best_of=1 or set an environment variable TLLM_ALLOW_N_GREEDY_DECODING=1 "
            "to allow best_of > 1 under the greedy decoding.",
            "n" if best_of == n else "best_of",
        )
    if stream and best_of > n:
        raise SpecError("best_of > n cannot be streamed: the best choices are known only at the end", "best_of")
    if best_of * num_prompts > MAX_SEQUENCES:
        raise SpecError(
            f"{num_prompts} prompt(s) x best_of {best_of} = {best_of * num_prompts} sequences; this server runs at "
            f"most {MAX_SEQUENCES} per request",
            "best_of" if best_of > n else "n",
        )
    if chat:
        wants = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        if top and not wants:
            raise SpecError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
        logprobs, echo = (top if wants else None), False
    else:
        v = body.get("logprobs")
        if isinstance(v, bool):  # JSON true is not an integer here (upstream's field is Optional[int])
            raise SpecError("'logprobs' must be an integer", "logprobs")
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
        echo = _bool(body, "echo")
    return ChoiceSpec(
        n=n,
        best_of=best_of,
        logprobs=logprobs,
        echo=echo,
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0, 0),
        stop_token_ids=_token_ids(body, "stop_token_ids", vocab_size),
        include_stop=_bool(body, "include_stop_str_in_output"),
    )


def _token_ids(body: dict, key: str, vocab_size: Optional[int]) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise SpecError(f"'{key}' must be a list of token ids", key)
    if len(v) > MAX_STOP_TOKENS:
        raise SpecError(f"'{key}' holds {len(v)} ids; at most {MAX_STOP_TOKENS}", key)
    bad = next((t for t in v if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        raise SpecError(f"'{key}' holds token id {str(bad)[:40]}, outside the vocabulary [0, {vocab_size})", key)
    return tuple(v)


def choice_seed(seed: Optional[int], i: int) -> Optional[int]:
    return None if seed is None else (seed + i) % SEED_MOD


def best(cum_logprobs: Sequence[float], n: int) -> list[int]:
    """Indices of the ``n`` largest cumulative logprobs, best first (ties: the earlier choice)."""
    return sorted(range(len(cum_logprobs)), key=lambda i: (-cum_logprobs[i], i))[:n]


def _lp(x: float) -> float:
    return max(x, LOGPROB_FLOOR)


def piece(decode: Callable[[list[int]], str], context: Sequence[int], token: int) -> str:
    """The text ``token`` adds after ``context`` (its last ``WINDOW`` tokens): with a SentencePiece vocabulary a
    token decoded alone loses its leading space, decoded in context it keeps it, so the pieces join to the text."""
    ctx = list(context[-WINDOW:]) if context else []
    return decode(ctx + [token])[len(decode(ctx)) :] if ctx else decode([token])


def completion_logprobs(
    decode: Callable[[list[int]], str],
    records: Sequence[Optional[TokenLogprob]],
    tokens: Sequence[int],
    context: Sequence[int] = (),
    offset: int = 0,
) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` of ``tokens`` (following ``context``): ``tokens`` (each token's text piece,
    :func:`piece`), ``token_logprobs``, ``top_logprobs`` (dict: the top k and the chosen token), ``text_offset``
    (from ``offset``, each piece's start). A ``None`` record (the first prompt token) gives ``null`` entries.
    Returns the object and the offset after the last piece."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    seq = list(context)
    for tok, rec in zip(tokens, records):
        s = piece(decode, seq, tok)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if rec is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(_lp(rec.logprob))
            top = {piece(decode, seq, tid): _lp(v) for tid, v in rec.top}
            top.setdefault(s, _lp(rec.logprob))
            out["top_logprobs"].append(top)
        seq.append(tok)
    return out, offset


def chat_logprobs(
    decode: Callable[[list[int]], str], records: Sequence[TokenLogprob], k: int, context: Sequence[int] = ()
) -> list[dict]:
    """OpenAI chat ``logprobs.content``: one ``{token, logprob, bytes, top_logprobs}`` per output token."""
    seq = list(context)

    def entry(tid: int, v: float) -> dict:
        s = piece(decode, seq, tid)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8", errors="replace"))}

    out = []
    for rec in records:
        e = entry(rec.token, rec.logprob)
        e["top_logprobs"] = [entry(tid, v) for tid, v in rec.top[:k]]
        out.append(e)
        seq.append(rec.token)
    return out
