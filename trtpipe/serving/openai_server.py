"""The OpenAI-compatible twin of ``trtllm-serve``: its HTTP endpoints over the in-flight batching executor.

A second front end over the same :class:`~trtpipe.serving.executor.Executor` the Triton twin uses (no scheduling
here): it translates OpenAI requests into executor :class:`Request` s, bridges the executor thread's responses
into asyncio, detokenizes incrementally and answers as ``trtllm-serve`` does:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template, or ``chat_template``
  given at start, as ``trtllm-serve --chat_template``), with ``stream: true`` as server-sent events ending in
  ``data: [DONE]``, ``stream_options.include_usage``, and the ``usage`` field;
* ``GET /v1/models``, ``GET /health`` (200, empty body), ``GET /version``;
* ``GET /metrics``: JSON per-iteration statistics since the last call (the executor's records), and
  ``GET /prometheus/metrics``: Prometheus text (request, token and error counters, trtllm-serve's latency histograms,
  running/waiting and KV-cache gauges).

A request without ``temperature`` samples at 1.0 (``top_p`` 1.0, ``top_k`` off), as trtllm-serve's
``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params`` send them
(``tensorrt_llm/serve/openai_protocol.py@0076e939``); ``temperature: 0`` is greedy.
String ``stop`` sequences are matched on the detokenized text; the request is then cancelled in the executor
and the text cut before the stop string (finish_reason ``stop``). A stream holds back the end of the text that a stop
string starts with until the next tokens decide, so its pieces join to the non-streamed text.

Requests are checked as trtllm-serve's pydantic models check them (``extra="forbid"``: an unknown field is a 400;
``priority`` in [0, 1], bigger first, default 0.5 — ``CompletionRequest.priority`` in tensorrt_llm/serve/
openai_protocol.py @0076e939); a field upstream knows but this twin does not compute is accepted only at its
default value, so nothing is silently ignored. Every failure is OpenAI-shaped (``{"error": {"message", "type",
"param", "code"}}``): 400 for the request itself (a lone surrogate included), 408 for a body not complete
after ``BODY_TIMEOUT_S``, 413 for a body over the size limit, 429 with ``Retry-After`` when
the executor queue is full or the request was shed for a higher priority, 503 with ``Retry-After`` once the
executor stopped (``/health`` turns 503 at the same moment, as upstream's does when the LLM is unavailable),
504 when the request ran past its allotted time (``serving.request_timeout_s``), 500 for anything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from trtpipe.extras import require
from trtpipe.serving.chat_output import (
    ChatOutput,
    ToolRequestError,
    raw_special_tokens,
    tool_call_grammar,
    tool_request,
)
from trtpipe.serving.api import (
    DEFAULT_PRIORITY,
    UINT64_MAX,
    ErrorKind,
    ExecutorConfig,
    FinishReason,
    PerfMetrics,
    Request,
    Response,
    SamplingParams,
)
from trtpipe.serving import request_checks
from trtpipe.serving import lora_metrics
from trtpipe.serving.adapters import AdapterRequestError, LoraSettings, LoraStepEngine, select_adapter
from trtpipe.serving.lora_metrics import LoraCounters
from trtpipe.serving.config import replace_knobs, twin_default
from trtpipe.serving.executor import Executor, ExecutorStopped, QueueFullError
from trtpipe.serving.end_tokens import read_end_tokens
from trtpipe.serving.guided import Guide, GuidedDecoder, GuideError, GuideType, response_format_guide
from trtpipe.serving.openai_choices import (
    ChoiceSpec,
    SpecError,
    best,
    chat_logprobs,
    choice_seed,
    choice_spec,
    completion_logprobs,
)
from trtpipe.serving.prom_text import histograms
from trtpipe.serving.speculative import prometheus_lines, usage_extension

web = require("aiohttp.web", "the OpenAI twin (trtpipe serve of an llmapi target)")

log = logging.getLogger("trtpipe.openai")

FINISH = {
    FinishReason.END_ID: "stop",
    FinishReason.STOP_WORDS: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMED_OUT: "length",
    FinishReason.CANCELLED: "stop",
}


def torch_threads() -> int:
    """The intra-op thread count chosen in this thread (torch's setting is per thread; the executor's is its own)."""
    import torch

    return torch.get_num_threads()


BODY_TIMEOUT_S = 30.0  # a request body not complete after this long is refused (408): it would hold its connection
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # where a JSON escape may make a lone surrogate (not text)
TOKENIZER_THREADS = 2  # the tokenizer's own pool: a long prompt waits there, not in the loop's shared pool
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request looks whether its client is still connected
RETRY_AFTER_S = 1  # what a refused client is told to wait at least (seconds, the Retry-After header's unit)
RETRY_AFTER_MAX_S = 60
RETRY_AFTER = web.AppKey("retry_after", object)  # the app's () -> seconds to put in Retry-After
MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused (413) before it is read whole
MAX_STOPS = 64


class Refused(Exception):
    """A request the server answers with an OpenAI-shaped error (``status``; ``retry`` adds Retry-After)."""

    status, etype, retry = 400, "BadRequestError", False

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param

    def response(self, retry_after_s: int = RETRY_AFTER_S) -> web.Response:
        return _error(self.status, str(self), self.param, self.etype, retry_after_s if self.retry else None)


class BadRequest(Refused):
    """400: the request itself is wrong."""


class Overloaded(Refused):
    status, etype, retry = 429, "RateLimitError", True


class Unavailable(Refused):
    status, etype, retry = 503, "ServiceUnavailableError", True


class TimedOut(Refused):
    status, etype = 504, "TimeoutError"


class Internal(Refused):
    status, etype = 500, "InternalServerError"


REFUSAL = {
    ErrorKind.INVALID: BadRequest,
    ErrorKind.OVERLOADED: Overloaded,
    ErrorKind.TIMED_OUT: TimedOut,
    ErrorKind.INTERNAL: Internal,
}


def _error_body(status: int, message: str, param: Optional[str] = None, etype: str = "BadRequestError") -> dict:
    """OpenAI's error object, plus trtllm-serve's flat ``ErrorResponse`` fields for clients written against it."""
    return {
        "object": "error",
        "message": message,
        "type": etype,
        "param": param,
        "code": status,
        "error": {"message": message, "type": etype, "param": param, "code": status},
    }


def _error(
    status: int,
    message: str,
    param: Optional[str] = None,
    etype: str = "BadRequestError",
    retry_after_s: Optional[int] = None,
) -> web.Response:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return web.json_response(_error_body(status, message, param, etype), status=status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Whatever goes wrong in a handler (or in aiohttp before it: unknown route, body too large) is OpenAI-shaped."""
    try:
        return await handler(request)
    except Refused as exc:
        retry = request.app.get(RETRY_AFTER)
        return exc.response(retry() if retry is not None and exc.retry else RETRY_AFTER_S)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        etype = (
            "NotFoundError" if exc.status == 404 else "BadRequestError" if exc.status < 500 else "InternalServerError"
        )
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        if exc.status == 413:
            message = f"the request body is larger than {MAX_BODY_BYTES} bytes"
        return _error(exc.status, message, etype=etype)
    except ConnectionResetError:  # the client left (mid-body): no one to answer
        log.info("%s %s: the client left before the request was read", request.method, request.path)
        return web.Response(status=400)
    except Exception as exc:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", etype="InternalServerError")


@dataclass
class Counters:
    """What /prometheus/metrics reports (lock: updated from the event loop only)."""

    success: dict = field(default_factory=dict)  # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    errors: int = 0  # refused (queue full) or failed after admission
    requests: int = 0
    running: int = 0
    hist: dict = field(default_factory=histograms)  # trtllm-serve's latency histograms
    lora: LoraCounters = field(default_factory=LoraCounters)  # per adapter (trtpipe.serving.lora_metrics)


class ServedModel:
    """Tokenizer + executor over the reference runtime of one model directory."""

    def __init__(
        self,
        model_dir: Path,
        name: str,
        config: Optional[ExecutorConfig] = None,
        chat_template: Optional[str] = None,
        *,
        tool_parser: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        lora: Optional[LoraSettings] = None,
        step_engine=None,
    ):
        """``step_engine``: the :class:`~trtpipe.serving.api.StepEngine` to run instead of one over ``model_dir``'s
        weights in this process (e.g. rank 0's :class:`~trtpipe.serving.mpi_engine.MpiStepEngine` of the same model
        split over MPI ranks)."""
        from transformers import AutoTokenizer

        from trtpipe.runtime.hf_loader import load_hf_checkpoint
        from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

        self.dir, self.name, self.created = Path(model_dir), name, int(time.time())
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser  # trtllm-serve's names, or None
        self.raw_special_tokens = raw_special_tokens(tool_parser, reasoning_parser)  # chat answers keep them
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir), trust_remote_code=False)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        model = load_hf_checkpoint(self.dir)
        self.max_seq_len = int(model.config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(model.config.get("vocab_size") or len(self.tokenizer))
        self.config = config or twin_default(self.max_seq_len)
        self.end_tokens = read_end_tokens(self.dir, self.tokenizer.eos_token_id)  # every eos id of the model
        self.eos_id = self.end_tokens.end_id
        # tokens >= characters / the longest token's characters: a prompt past that bound is refused untokenized
        self.max_chars_per_token = request_checks.longest_token_chars(self.tokenizer.get_vocab())
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="trtpipe-tokenize")
        self.guided = GuidedDecoder.from_tokenizer(self.config.guided_decoding_backend, self.tokenizer, self.vocab_size)
        engine = step_engine if step_engine is not None else ReferenceEngine(model)
        self.adapters = None  # the LoRA cache (trtpipe.serving.adapters)
        if lora is not None:
            self.adapters = lora.cache(self.dir)
            engine = LoraStepEngine(engine, self.adapters)
            self.config = replace_knobs(self.config, max_loras=self.config.max_loras or lora.max_loras)
        self.executor = Executor(
            self.config,
            engine,
            threads=torch_threads(),
            guided=self.guided,
            draft_engine=draft_engine(self.config, model, self.dir),
        )

    def refuse_long_text(self, text: str, param: str) -> None:
        """400 before tokenizing when ``text`` cannot fit the context whatever it tokenizes to: at least
        ``ceil(chars / max_chars_per_token)`` tokens (tokenizing 4 MB costs gigabytes and seconds of every
        request's time, only to be refused after)."""
        try:
            request_checks.refuse_untokenized(
                len(text),
                self.max_chars_per_token,
                self.max_seq_len - 1,
                f"leaves no room in max_seq_len {self.max_seq_len}",
            )
        except ValueError as exc:
            raise BadRequest(str(exc), param) from None

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)


# --- request translation --------------------------------------------------------------------------------------


def _refuse_lone_surrogates(body: Any) -> None:
    """400 when a string of ``body`` holds a lone surrogate (a ``\\ud800`` escape without its pair): JSON parses it,
    but it is no Unicode text, and the tokenizer fails on it (it was a 500)."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("utf-8", "backslashreplace").decode()
        raise BadRequest(f"the request body holds a lone surrogate ({bad}), which is not Unicode text") from None


def _num(body: dict, key: str, typ, default, lo=None, hi=None):
    v = body.get(key, default)
    if v is None:
        return default
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be an integer", key)
    if typ is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise BadRequest(f"'{key}' must be a finite number", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], got {str(v)[:40]}", key)
    return typ(v)


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be a boolean", key)
    return v


# The request fields of trtllm-serve's CompletionRequest / ChatCompletionRequest (openai_protocol.py @0076e939).
# USED: read by this twin. AT_DEFAULT: upstream computes them, the twin does not: accepted only at these values.
USED = {
    "completions": {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "best_of",
        "logprobs",
        "echo",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "priority",
        "user",
        "response_format",
        "lora_request",
    },
    "chat": {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "include_stop_str_in_output",
        "priority",
        "user",
        "parallel_tool_calls",
        "reasoning_effort",
        "tools",
        "tool_choice",
        "response_format",
        "lora_request",
    },
}
_SHARED_DEFAULTS = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "use_beam_search": (False,),
    "min_p": (0,),
    "top_p_min": (0,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "length_penalty": (),
    "early_stopping": (),
    "truncate_prompt_tokens": (),
    "prompt_ignore_length": (0,),
    "disaggregated_params": (),
    "conversation_params": (),
    "thinking_token_budget": (),
}
AT_DEFAULT = {
    "completions": {
        **_SHARED_DEFAULTS,
        "suffix": ("",),
        "add_special_tokens": (True,),
        "return_context_logits": (False,),
        "detokenize": (True,),
    },
    "chat": {
        **_SHARED_DEFAULTS,
        "echo": (False,),  # chat's echo prepends the last message (upstream's meaning), not computed here
        "add_generation_prompt": (True,),
        "add_special_tokens": (False,),
        "documents": (),
        "chat_template": (),
        "chat_template_kwargs": ({},),
        "cache_salt": (),
    },
}


def _check_fields(body: dict, endpoint: str) -> None:
    """Unknown fields are refused (upstream forbids extras); known ones this twin does not compute only at default."""
    for key, value in body.items():
        if key in USED[endpoint]:
            continue
        if key not in AT_DEFAULT[endpoint]:
            raise BadRequest(f"'{str(key)[:64]}': extra inputs are not permitted", str(key)[:64])
        if (
            value is not None
            and not any(type(value) is type(ok) and value == ok for ok in AT_DEFAULT[endpoint][key])
            and not any(
                isinstance(ok, (int, float))
                and not isinstance(ok, bool)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value == ok
                for ok in AT_DEFAULT[endpoint][key]
            )
        ):
            raise BadRequest(
                f"'{key}' is not supported by this server (only its default, "
                f"{AT_DEFAULT[endpoint][key][0] if AT_DEFAULT[endpoint][key] else None!r})",
                key,
            )


def _sampling(body: dict) -> SamplingParams:
    # unset: temperature 1.0 and top_p 1.0, as trtllm-serve's to_sampling_params send them (top_k 0: off)
    # (CompletionRequest / ChatCompletionRequest, tensorrt_llm/serve/openai_protocol.py@0076e939)
    temperature = _num(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", float, 1.0, 0.0, 1.0)
    top_k = _num(body, "top_k", int, 0, 0, None)
    seed = _num(body, "seed", int, None, 0, UINT64_MAX)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that a stop string starts with: held back from a stream, since the
    next tokens may complete the stop string (then it is cut, and none of it may have been sent)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", "stop")
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"'stop' holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    return stops


def _check_unsupported(body: dict) -> None:
    for key, kind in (("user", str), ("reasoning_effort", str), ("parallel_tool_calls", bool)):  # read, unused
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise BadRequest(f"'{key}' must be a {kind.__name__}", key)


def _guide(body: dict) -> Optional[Guide]:
    """The executor's guide of ``response_format`` (trtpipe.serving.guided: one mapping, upstream's messages)."""
    try:
        return response_format_guide(body.get("response_format"))
    except GuideError as exc:
        raise BadRequest(str(exc), "response_format") from None


def _stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options only with stream, as upstream's validator says."""
    stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("Stream options can only be defined when stream is true.", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("'stream_options' must be an object with include_usage", "stream_options")
    return stream, _flag(options, "include_usage", False)


class Generation:
    """One request in flight: the executor's responses arrive on ``queue`` (thread-safe hand-off).

    The executor streams tokens only to a client that streams, or when stop strings must be watched as the text
    grows; any other request gets one final response, as a non-streaming ``generate_async`` does upstream. That keeps
    the event loop (and the GIL it shares with the executor thread) free of per-token work for batch requests, which
    otherwise delays every interactive request on the same server."""

    def __init__(
        self,
        served: ServedModel,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stops: list[str],
        loop: asyncio.AbstractEventLoop,
        priority: float = DEFAULT_PRIORITY,
        stream: bool = True,
        *,
        guide: Optional[Guide] = None,
        lora: Optional[str] = None,
        logprobs: Optional[int] = None,
        prompt_logprobs: Optional[int] = None,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        stop_token_ids: tuple = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.served, self.prompt, self.stops, self.lora = served, prompt, stops, lora
        self.skip_special_tokens = skip_special_tokens  # False: a chat answer for parsers that read special tokens
        end_id, stop_token_ids = served.end_tokens.for_request(ignore_eos, stop_token_ids)  # end_tokens.py
        self.stop_token_ids, self.include_stop = frozenset(stop_token_ids), include_stop
        self.logprobs: list = []  # TokenLogprob per token of ids (with logprobs)
        self.prompt_logprobs: Optional[list] = None  # per prompt token, None first (with prompt_logprobs)
        self.logprobs_sent = 0  # tokens whose logprobs a stream has sent
        self.text_offset = 0  # the next token's text_offset in a completions stream
        self.echoed = False  # a stream has sent the echoed prompt
        self._prefix_len = [0]  # characters of the decoded first j tokens, as far as computed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already given to the client
        self.finish: Optional[str] = None
        self.t0 = time.perf_counter()
        self.ttft: Optional[float] = None
        self.stopped = False
        self.failed = False
        self.streamed = stream or bool(stops)  # the executor streams tokens (else: one final response)
        req = Request(
            prompt=prompt,
            max_new_tokens=max_tokens,
            end_id=end_id,
            sampling=sampling,
            streaming=self.streamed,
            exclude_input_from_output=True,
            priority=priority,
            return_perf_metrics=True,
            guide=guide,
            lora=lora,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=min_tokens,
            stop_words=[[t] for t in sorted(self.stop_token_ids)],
        )
        self.perf = None  # the executor's PerfMetrics, on the final response
        try:
            self.rid = served.executor.submit(req, lambda r: loop.call_soon_threadsafe(self.queue.put_nowait, r))
        except QueueFullError as exc:
            raise Overloaded(str(exc)) from None
        except ExecutorStopped as exc:
            raise Unavailable(f"LLM is unavailable: {exc}") from None

    def cancel(self) -> None:
        self.served.executor.cancel(self.rid)

    async def deltas(self):
        """Yield text deltas until the request ends; ``finish`` is set at the end."""
        while True:
            resp: Response = await self.queue.get()
            if resp.has_error:
                self.failed = True
                raise REFUSAL.get(resp.error_kind, Internal)(resp.error)
            if resp.is_final and resp.perf is not None:
                self.perf = resp.perf
                if not self.streamed and resp.perf.first_token_ns:  # no token arrived before: the executor's clock
                    self.ttft = (resp.perf.first_token_ns - resp.perf.enqueue_ns) / 1e9
            if self.stopped:  # already cut at a stop string: drain to the final response
                if resp.is_final:
                    return
                continue
            if resp.tokens and self.ttft is None:
                self.ttft = time.perf_counter() - self.t0
            self.ids.extend(resp.tokens)
            self.logprobs.extend(resp.logprobs or ())
            if resp.prompt_logprobs is not None:
                self.prompt_logprobs = resp.prompt_logprobs
            if (
                resp.is_final
                and resp.finish_reason == FinishReason.STOP_WORDS
                and not self.include_stop
                and self.ids
                and self.ids[-1] in self.stop_token_ids
            ):  # a stop token leaves the output unless asked (tensorrt_llm/executor/result.py, _handle_sequence)
                del self.ids[-1]
                del self.logprobs[len(self.ids) :]
            text = self.served.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            hits = [(i, s) for s in self.stops for i in (text.find(s),) if i >= 0]
            if hits:
                cut, stop = min(hits)
                text, self.stopped, self.finish = text[: cut + (len(stop) if self.include_stop else 0)], True, "stop"
                self.cancel()
            self.text = text
            upto = len(text) if self.stopped else len(text) - _stop_prefix(text, self.stops)
            if not text[:upto].endswith("\ufffd") and upto > self.sent:  # hold back a partial UTF-8 character
                delta, self.sent = text[self.sent : upto], upto
                yield delta
            if resp.is_final:
                if not self.stopped:
                    self.finish = FINISH.get(resp.finish_reason, "length")
                if len(self.text) > self.sent:
                    delta, self.sent = self.text[self.sent :], len(self.text)
                    yield delta
                return

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def _chars(self, j: int) -> int:
        """Characters of the decoded first ``j`` tokens (each prefix decoded once; only with stop strings)."""
        while len(self._prefix_len) <= j:
            m = len(self._prefix_len)
            self._prefix_len.append(
                len(self.served.tokenizer.decode(self.ids[:m], skip_special_tokens=self.skip_special_tokens))
            )
        return self._prefix_len[j]

    def kept(self) -> int:
        """Tokens of the answer: all, or when cut at a stop string the fewest whose text reaches the cut."""
        if not self.stopped:
            return len(self.ids)
        return next((j for j in range(len(self.ids) + 1) if self._chars(j) >= len(self.text)), len(self.ids))

    @property
    def cum_log_prob(self) -> float:
        return sum(x.logprob for x in self.logprobs[: self.kept()])

    def take_logprobs(self, final: bool) -> list:
        """The logprobs a stream sends now: of every token not sent yet whose text is sent (with stop strings the
        held-back text's tokens wait, since a stop string may still cut them), or of all kept ones at the end."""
        if final:
            end = self.kept()
        elif not self.stops:
            end = len(self.ids)
        else:
            end = self.logprobs_sent
            while end < len(self.ids) and self._chars(end + 1) <= self.sent:
                end += 1
        out = self.logprobs[self.logprobs_sent : end]
        self.logprobs_sent = max(self.logprobs_sent, end)
        return out


def _choice_output(out: Optional[ChatOutput]) -> Optional[ChatOutput]:
    """A fresh copy of a chat request's parsers for one choice (a stream's parsers keep state per choice)."""
    return None if out is None else ChatOutput(out.reasoning, out.tool, out.tools, guide=out.guide)


async def _merged(gens: list):
    """``(choice index, text delta)`` of several generations as they come, and ``(index, None)`` when one ends; the
    first error of any is raised (the caller cancels the others)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation):
        try:
            async for delta in g.deltas():
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            left -= delta is None
            yield i, delta
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


async def _while_connected(request: web.Request, deltas):
    """``deltas``, item by item, raising ``ConnectionResetError`` when the client closes the connection while it
    waits for the next one: a stream writes nothing while its request is queued, so a write cannot tell."""
    it = deltas.__aiter__()
    while True:
        step = asyncio.ensure_future(it.__anext__())
        try:
            while not step.done():
                await asyncio.wait({step}, timeout=DISCONNECT_POLL_S)
                if not step.done() and (request.transport is None or request.transport.is_closing()):
                    raise ConnectionResetError(f"{request.path}: the client left before its stream ended")
        finally:
            if not step.done():
                step.cancel()
        try:
            delta = step.result()
        except StopAsyncIteration:
            return
        yield delta


# --- the app ---------------------------------------------------------------------------------------------------


class OpenAIServer:
    def __init__(self, served: ServedModel):
        self.served = served
        self.counters = Counters()
        self._last_iter = -1
        self.app = web.Application(middlewares=[openai_errors], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/version", self.version),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/metrics", self.metrics),
                web.get("/prometheus/metrics", self.prometheus),
            ]
        )
        self.app[RETRY_AFTER] = self.retry_after_s
        self.app.on_shutdown.append(self._on_shutdown)

    def retry_after_s(self) -> int:
        """Seconds until the queue, as it stands, has drained at the rate requests finish lately (whole seconds,
        at least 1, at most 60); 1 before any rate is known or once the executor stopped."""
        drain = self.served.executor.core.drain_time_s() if self.served.executor.healthy else None
        return RETRY_AFTER_S if drain is None else max(RETRY_AFTER_S, min(RETRY_AFTER_MAX_S, math.ceil(drain)))

    async def _on_shutdown(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.served.shutdown)

    async def health(self, request: web.Request) -> web.Response:
        if self.served.executor.healthy:
            return web.Response(status=200)
        return web.Response(
            status=503,
            text="LLM is unavailable. Please check the server logs for more details.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def version(self, request: web.Request) -> web.Response:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("trtpipe")
        except PackageNotFoundError:  # pragma: no cover
            v = "0"
        return web.json_response({"version": f"trtpipe-twin {v}"})

    async def models(self, request: web.Request) -> web.Response:
        s = self.served
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": s.created, "owned_by": "tensorrt_llm"}
                    for n in [s.name, *(s.adapters.names if s.adapters else ())]
                ],
            }
        )

    async def _body(self, request: web.Request, endpoint: str) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise web.HTTPRequestTimeout(
                text=f"{request.method} {request.path}: the request body was not complete after {BODY_TIMEOUT_S:g} s"
            ) from None
        try:
            body = json.loads(raw.decode("utf-8"))
        except (ValueError, RecursionError):  # bad JSON, bad UTF-8 (UnicodeDecodeError), nesting past the parser
            raise BadRequest("the request body is not valid JSON (UTF-8)") from None
        if LONE_SURROGATE.search(raw):
            _refuse_lone_surrogates(body)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.served.name and model not in self._adapter_names():
            raise BadRequest(f"The model `{str(model)[:200]}` does not exist.", "model")
        _check_fields(body, endpoint)
        _check_unsupported(body)
        return body

    def _adapter_names(self) -> list[str]:
        return self.served.adapters.names if self.served.adapters else []

    def _lora(self, body: dict) -> Optional[str]:
        """The request's LoRA adapter (by ``model`` or ``lora_request``), or None (run off the event loop: a new
        ``lora_path`` is read from disk)."""
        try:
            return select_adapter(self.served.adapters, self.served.name, body.get("model"), body.get("lora_request"))
        except AdapterRequestError as exc:
            raise BadRequest(str(exc), exc.param) from None

    def _max_tokens(self, body: dict, prompt_len: int, default: Optional[int], param: str) -> int:
        room = self.served.max_seq_len - prompt_len
        if room < 1:
            raise BadRequest(
                f"the prompt ({prompt_len} tokens) leaves no room in max_seq_len {self.served.max_seq_len}", param
            )
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        n = _num(body, key, int, None, 1, None)
        if n is None:
            return min(default, room) if default else room
        return min(n, room)

    def _prompt_ids(self, prompt: Any) -> list[tuple[list[int], str]]:
        """(token ids, echo text) of each completion prompt: a string, a list of strings, a list of token ids or a
        list of lists of token ids (run off the event loop: a 1 MB prompt takes a while to encode)."""
        tok = self.served.tokenizer
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest("'prompt' must be a string, a list of strings, or token ids", "prompt")
            out = []
            for text in texts:
                self.served.refuse_long_text(text, "prompt")
                out.append((tok.encode(text, add_special_tokens=True), text))
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            out = [(self._token_prompt(p), None) for p in prompt]
        elif isinstance(prompt, list) and prompt:
            out = [(self._token_prompt(prompt), None)]
        else:
            raise BadRequest(
                "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
                "prompt",
            )
        if any(not ids for ids, _ in out):
            raise BadRequest("the prompt is empty", "prompt")
        return [(ids, text if text is not None else tok.decode(ids, skip_special_tokens=False)) for ids, text in out]

    def _token_prompt(self, prompt: list) -> list[int]:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest(
                "'prompt' must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
                "prompt",
            )
        bad = next((t for t in prompt if not 0 <= t < self.served.vocab_size), None)
        if bad is not None:  # an id outside the vocabulary would fail the whole batched step
            raise BadRequest(
                f"'prompt' holds token id {str(bad)[:40]}, outside the vocabulary [0, {self.served.vocab_size})",
                "prompt",
            )
        return list(prompt)

    def _chat_ids(self, messages: Any, tools: Optional[list] = None) -> list[int]:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and (m.get("content") is None or isinstance(m.get("content"), (str, list)))
                for m in messages
            )
        ):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        tok = self.served.tokenizer
        if not tok.chat_template:
            raise BadRequest("this model's tokenizer has no chat template (start the server with one)", "messages")
        try:
            text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja errors from the template itself, content it cannot render
            raise BadRequest(f"chat template failed: {str(exc)[:300]}", "messages") from None
        if not isinstance(text, str):
            raise BadRequest("the chat template did not render text", "messages")
        self.served.refuse_long_text(text, "messages")
        return tok.encode(text, add_special_tokens=False)

    def _refuse_early(self, body: dict) -> None:
        """503 once the executor stopped, 429 when its queue would refuse this priority: before any tokenizing, so
        an overloaded server answers in the time it takes to parse the JSON."""
        executor = self.served.executor
        if not executor.healthy:
            raise Unavailable(f"LLM is unavailable: the executor is not running: {executor.stopped_because}")
        why = executor.core.refusal(_num(body, "priority", float, DEFAULT_PRIORITY, 0.0, 1.0))
        if why:
            raise Overloaded(why)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "completions")
        self._refuse_early(body)
        prompts = await asyncio.get_running_loop().run_in_executor(
            self.served.tokenize_pool, self._prompt_ids, body.get("prompt")
        )
        return await self._serve(request, body, prompts, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "chat")
        self._refuse_early(body)
        out = self._chat_output(body)
        ids = await asyncio.get_running_loop().run_in_executor(
            self.served.tokenize_pool, self._chat_ids, body.get("messages"), out.tools.tools if out.tools else None
        )
        return await self._serve(request, body, [(ids, "")], chat=True, out=out)

    def _chat_output(self, body: dict) -> ChatOutput:
        """The request's tools checked (400 naming the field) and its answer's parsers."""
        try:
            tools = tool_request(body, self.served.tool_parser)
        except ToolRequestError as exc:
            raise BadRequest(str(exc), exc.param) from None
        out = ChatOutput(self.served.reasoning_parser, self.served.tool_parser, tools)
        if tools is not None and tools.constrained:  # the calls are constrained by a grammar, so they always parse
            if self.served.guided is None:
                raise BadRequest(
                    f"tool_choice {tools.choice!r} needs guided decoding: start the server with a "
                    "guided_decoding_backend (recipe serving.guided_decoding_backend: xgrammar)",
                    "tool_choice",
                )
            if body.get("response_format") not in (None, {"type": "text"}):
                raise BadRequest("Only one guide can be used for a request, but got 2.", "tool_choice")
            try:
                out.guide = Guide(
                    GuideType.STRUCTURAL_TAG,
                    json.dumps(
                        tool_call_grammar(self.served.tool_parser, tools, body.get("parallel_tool_calls") is not False)
                    ),
                )
            except ToolRequestError as exc:
                raise BadRequest(str(exc), exc.param) from None
        return out

    def _start(
        self, body: dict, prompts: list, spec: ChoiceSpec, chat: bool, stream: bool, guide, lora
    ) -> list[Generation]:
        """One executor request per (prompt, choice), prompt-major; all cancelled if one cannot start."""
        loop = asyncio.get_running_loop()
        sampling, stops = _sampling(body), _stops(body)
        priority = _num(body, "priority", float, DEFAULT_PRIORITY, 0.0, 1.0)
        param = "messages" if chat else "prompt"
        limits = [self._max_tokens(body, len(ids), None if chat else 16, param) for ids, _ in prompts]
        gens: list[Generation] = []
        try:
            for (ids, _), max_tokens in zip(prompts, limits):
                for c in range(spec.best_of):
                    gens.append(
                        Generation(
                            self.served,
                            ids,
                            max_tokens,
                            replace(sampling, seed=choice_seed(sampling.seed, c)),
                            stops,
                            loop,
                            priority,
                            stream,
                            guide=guide,
                            lora=lora,
                            logprobs=spec.executor_logprobs,
                            prompt_logprobs=spec.logprobs if spec.echo and (c == 0 or stream) else None,
                            ignore_eos=spec.ignore_eos,
                            min_tokens=spec.min_tokens,
                            stop_token_ids=spec.stop_token_ids,
                            include_stop=spec.include_stop,
                            skip_special_tokens=not (chat and self.served.raw_special_tokens),
                        )
                    )
        except Refused:  # 429 / 503 at admission: a request error for trtllm_request_error_total
            for g in gens:
                g.cancel()
            self.counters.errors += 1
            raise
        return gens

    async def _serve(
        self, request: web.Request, body: dict, prompts: list, chat: bool, out: Optional[ChatOutput] = None
    ) -> web.StreamResponse:
        """``prompts``: (token ids, echo text) per prompt; answers ``n`` choices per prompt (index ``p * n + i``).
        ``out``: a chat request's parsers (tools, reasoning); each choice parses its own text with a copy."""
        stream, include_usage = _stream_settings(body)
        try:
            spec = choice_spec(body, chat, _sampling(body).greedy, stream, len(prompts), self.served.vocab_size)
        except SpecError as exc:
            raise BadRequest(str(exc), exc.param) from None
        guide = out.guide if out is not None and out.guide is not None else _guide(body)
        lora = await asyncio.get_running_loop().run_in_executor(self.served.tokenize_pool, self._lora, body)
        gens = self._start(body, prompts, spec, chat, stream, guide, lora)
        outs = [_choice_output(out) for _ in gens] if chat else [None] * len(gens)
        self.counters.requests += 1
        self.counters.running += 1
        self.counters.lora.begin(lora)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if stream:
                return await self._stream(request, gens, prompts, spec, rid, created, chat, include_usage, outs)
            finished = await asyncio.gather(*(self._finish_while_connected(request, g) for g in gens))
            if not all(finished):
                return web.Response(status=499)  # nobody reads it: the client closed the connection
        except BaseException:  # the client went away, or one choice failed: free every executor slot
            for g in gens:
                g.cancel()
            raise
        finally:
            self.counters.running -= 1
            self.counters.lora.end(lora)
            for g in gens:
                self._account(g)
        choices, answered = [], []
        for p, (ids, echo_text) in enumerate(prompts):
            first = p * spec.best_of
            group = gens[first : first + spec.best_of]
            order = best([g.cum_log_prob for g in group], spec.n) if spec.best_of > spec.n else range(spec.n)
            for i, k in enumerate(order):
                g = group[k]
                answered.append(g)
                choices.append(
                    self._choice(g, p * spec.n + i, spec, chat, echo_text, group[0].prompt_logprobs, outs[first + k])
                )
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": self.served.name,
                "choices": choices,
                "usage": self._usage(prompts, answered),
            }
        )

    def _decode(self, ids: list[int]) -> str:
        return self.served.tokenizer.decode(ids, skip_special_tokens=False)

    def _choice(
        self,
        g: Generation,
        index: int,
        spec: ChoiceSpec,
        chat: bool,
        echo_text: str,
        prompt_lps,
        out: Optional[ChatOutput] = None,
    ) -> dict:
        decode = self._decode
        kept = g.kept()
        if chat:
            logprobs = None
            if spec.logprobs is not None:
                logprobs = {"content": chat_logprobs(decode, g.logprobs[:kept], spec.logprobs)}
            return {
                "index": index,
                "message": out.message(g.text),
                "logprobs": logprobs,
                "finish_reason": out.finish_reason(g.finish),
            }
        text, logprobs = g.text, None
        if spec.echo:
            text = echo_text + text
        if spec.logprobs is not None:
            logprobs, offset = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
            if spec.echo:  # the prompt's pieces, then the output's (whose text is decoded on its own)
                logprobs, offset = completion_logprobs(decode, prompt_lps or [None] * len(g.prompt), g.prompt)
            out_lp, _ = completion_logprobs(decode, g.logprobs[:kept], g.ids[:kept], (), offset)
            logprobs = {key: logprobs[key] + out_lp[key] for key in out_lp}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": g.finish}

    @staticmethod
    async def _finish_while_connected(request: web.Request, g: Generation) -> bool:
        """Run ``g`` to its end; False when the client closed the connection first (then ``g`` is cancelled in the
        executor: aiohttp does not cancel a handler whose client left, and a non-streaming request writes nothing
        that would fail, so without this look it would generate until its deadline)."""

        async def drain():
            async for _ in g.deltas():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and (request.transport is None or request.transport.is_closing()):
                    g.cancel()
                    await task  # the executor's final response for the cancelled request
                    return False
            await task  # its exception (an executor error) is the handler's
            return True
        finally:
            if not task.done():
                task.cancel()

    def _stream_logprobs(self, g: Generation, spec: ChoiceSpec, chat: bool, final: bool, prompt=None):
        """The ``logprobs`` of one stream chunk: the tokens :meth:`Generation.take_logprobs` releases, or with
        ``prompt`` ((tokens, records) of an echo) the prompt's."""
        if spec.logprobs is None:
            return None
        context: list[int] = []
        if prompt is not None:
            tokens, records = prompt
        else:
            start = g.logprobs_sent
            records = g.take_logprobs(final)
            tokens, context = [r.token for r in records], g.ids[:start]
        if chat:
            return {"content": chat_logprobs(self._decode, records, spec.logprobs, context)}
        out, g.text_offset = completion_logprobs(self._decode, records, tokens, context, g.text_offset)
        return out

    async def _stream(
        self,
        request,
        gens: list,
        prompts: list,
        spec: ChoiceSpec,
        rid: str,
        created: int,
        chat: bool,
        usage: bool,
        outs: list,
    ):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, delta, finish: Optional[str], first: bool = False, logprobs=None) -> bytes:
            """``delta``: for chat, a dict of the message's fields (ChatOutput's) or None; else text."""
            if chat:
                d = {"role": "assistant", "content": ""} if first else (delta or {})
                choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": self.served.name, "choices": [choice]}
            if usage:
                payload["usage"] = None
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        async def pieces(i: int, texts: list, finish: Optional[str], logprobs) -> None:
            """Chunks of choice ``i``: the logprobs ride on the first (an empty delta carries them when the
            parsers hold every piece back), the finish reason on the last."""
            texts = texts or ([None] if logprobs is not None or finish is not None else [])
            for j, t in enumerate(texts):
                last = j == len(texts) - 1
                await resp.write(chunk(i, t, finish if last else None, logprobs=logprobs if j == 0 else None))

        n = spec.n  # best_of == n when streaming (choice_spec)
        try:
            for i, g in enumerate(gens):
                if chat:
                    await resp.write(chunk(i, None, None, first=True))
            async for i, delta in _while_connected(request, _merged(gens)):
                g, out = gens[i], outs[i]
                if spec.echo and not g.echoed:  # the prompt (and its logprobs) leads the choice's text
                    g.echoed = True
                    records = g.prompt_logprobs or [None] * len(g.prompt)
                    lp = self._stream_logprobs(g, spec, chat, False, (list(g.prompt), list(records)))
                    await resp.write(chunk(i, prompts[i // n][1], None, logprobs=lp))
                if delta is None:  # this choice ended: what the parsers held back, then its finish reason
                    lp = self._stream_logprobs(g, spec, chat, final=True)
                    if chat:
                        await pieces(i, out.finish(), None, lp)
                        await resp.write(chunk(i, None, out.finish_reason(g.finish)))
                    else:
                        await resp.write(chunk(i, "", g.finish, logprobs=lp))
                    continue
                lp = self._stream_logprobs(g, spec, chat, final=False)
                await pieces(i, out.feed(delta) if chat else [delta], None, lp)
            if usage:
                payload = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.served.name,
                    "choices": [],
                    "usage": self._usage(prompts, gens),
                }
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client left mid-stream: free its executor slots, nothing to answer
            for g in gens:
                g.cancel()
            return resp
        except asyncio.CancelledError:
            for g in gens:
                g.cancel()
            raise
        except Refused as exc:  # the status line is sent already: the error goes as the last event
            for g in gens:
                g.cancel()
            body = _error_body(exc.status, str(exc), exc.param, exc.etype)
            await resp.write(b"data: " + json.dumps({"error": body["error"]}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _usage(self, prompts: list, answered: list) -> dict:
        """Prompt tokens once per prompt; completion tokens of the choices answered (as trtllm-serve counts); with
        speculative decoding, the choices' acceptance summed (:func:`~trtpipe.serving.speculative.usage_extension`)."""
        p = sum(len(ids) for ids, _ in prompts)
        n = sum(g.completion_tokens for g in answered)
        usage = {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
        perfs = [g.perf for g in answered if g.perf is not None]
        if self.served.config.speculative_decoding_type and perfs:
            total = PerfMetrics(
                total_draft_tokens=sum(x.total_draft_tokens for x in perfs),
                total_accepted_draft_tokens=sum(x.total_accepted_draft_tokens for x in perfs),
            )
            usage.update(usage_extension(total))
        return usage

    def _account(self, g: Generation) -> None:
        """Per-request metrics as trtllm-serve logs them (TPOT = decode time / (tokens - 1))."""
        c = self.counters
        c.lora.account(g.lora, g.failed, g.finish, len(g.prompt), g.completion_tokens)
        if g.failed:
            c.errors += 1
            return
        c.success[g.finish or "error"] = c.success.get(g.finish or "error", 0) + 1
        c.prompt_tokens += len(g.prompt)
        c.generation_tokens += g.completion_tokens
        e2e = time.perf_counter() - g.t0
        c.hist["trtllm_e2e_request_latency_seconds"].observe(e2e)
        if g.ttft is not None:
            c.hist["trtllm_time_to_first_token_seconds"].observe(g.ttft)
            if g.completion_tokens > 1:
                c.hist["trtllm_time_per_output_token_seconds"].observe((e2e - g.ttft) / (g.completion_tokens - 1))
        if g.perf is not None and g.perf.first_scheduled_ns:
            c.hist["trtllm_request_queue_time_seconds"].observe((g.perf.first_scheduled_ns - g.perf.enqueue_ns) / 1e9)

    async def metrics(self, request: web.Request) -> web.Response:
        s = self.served.executor.stats()
        if s is None or s.iteration == self._last_iter:
            return web.json_response([])
        self._last_iter = s.iteration
        return web.json_response(
            [
                {
                    "iter": s.iteration,
                    "iterLatencyMS": s.step_time_s * 1e3,
                    "timestamp_ns": s.timestamp_ns,
                    "numActiveRequests": s.num_active,
                    "maxNumActiveRequests": s.max_active,
                    "numQueuedRequests": s.num_queued,
                    "inflightBatchingStats": {
                        "numScheduledRequests": s.num_scheduled,
                        "numContextRequests": s.num_context_requests,
                        "numCtxTokens": s.num_context_tokens,
                        "numGenRequests": s.num_generation_requests,
                        "numPausedRequests": s.num_paused,
                    },
                    "kvCacheStats": {
                        "maxNumBlocks": s.kv.max_blocks,
                        "freeNumBlocks": s.kv.free_blocks,
                        "usedNumBlocks": s.kv.used_blocks,
                        "tokensPerBlock": s.kv.tokens_per_block,
                        "allocTotalBlocks": s.kv.alloc_total_blocks,
                        "allocNewBlocks": s.kv.alloc_new_blocks,
                        "reusedBlocks": s.kv.reused_blocks,
                        "missedBlocks": s.kv.missed_blocks,
                        "cacheHitRate": s.kv.cache_hit_rate,
                    },
                }
            ]
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        c, s, name = self.counters, self.served.executor.stats(), self.served.name
        labels = f'model_name="{name}",engine_type="trtllm"'
        lines = ["# TYPE trtllm_request_success_total counter"]
        for reason, n in sorted(c.success.items()):
            lines.append(f'trtllm_request_success_total{{{labels},finished_reason="{reason}"}} {n}')
        lines += [
            "# TYPE trtllm_prompt_tokens_total counter",
            f"trtllm_prompt_tokens_total{{{labels}}} {c.prompt_tokens}",
            "# TYPE trtllm_generation_tokens_total counter",
            f"trtllm_generation_tokens_total{{{labels}}} {c.generation_tokens}",
            "# TYPE trtllm_request_error_total counter",
            f"trtllm_request_error_total{{{labels}}} {c.errors}",
        ]
        for h in c.hist.values():
            lines += h.lines(labels)
        kv = s.kv if s else None
        if self.served.executor.core.speculator is not None:
            lines += prometheus_lines(self.served.executor.core.speculator, labels)
        lines += [
            "# TYPE trtllm_num_requests_running gauge",
            f"trtllm_num_requests_running{{{labels}}} {s.num_scheduled if s else 0}",
            "# TYPE trtllm_num_requests_waiting gauge",
            f"trtllm_num_requests_waiting{{{labels}}} {(s.num_queued + s.num_waiting) if s else 0}",
            "# TYPE trtllm_kv_cache_utilization gauge",
            f"trtllm_kv_cache_utilization{{{labels}}} "
            f"{(kv.used_blocks / kv.max_blocks) if kv and kv.max_blocks else 0.0}",
        ]
        for what in ("max", "free", "used"):
            lines += [
                f"# TYPE trtllm_kv_cache_{what}_blocks gauge",
                f"trtllm_kv_cache_{what}_blocks{{{labels}}} {getattr(kv, what + '_blocks') if kv else 0}",
            ]
        lines += [
            "# TYPE trtllm_kv_cache_hit_rate gauge",
            f"trtllm_kv_cache_hit_rate{{{labels}}} {kv.cache_hit_rate if kv else 0.0}",
        ]
        if self.served.guided is not None:
            lines += self.served.guided.prometheus_lines(labels)
        if self.served.adapters is not None:
            engine = self.served.executor.core.engine
            lines += lora_metrics.prometheus_lines(c.lora, engine, labels, self.served.config.max_loras)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def serve(
    model_dir: Path,
    host: str,
    port: int,
    name: str,
    config: Optional[ExecutorConfig] = None,
    chat_template: Optional[str] = None,
    *,
    tool_parser: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
    lora: Optional[LoraSettings] = None,
) -> None:
    """Run the server until interrupted (blocking)."""
    served = ServedModel(
        model_dir, name, config, chat_template, tool_parser=tool_parser, reasoning_parser=reasoning_parser, lora=lora
    )
    server = OpenAIServer(served)
    log.info("serving %s as %r on http://%s:%d (OpenAI-compatible; trtllm-serve twin)", model_dir, name, host, port)
    web.run_app(server.app, host=host, port=port, print=None, handle_signals=True, shutdown_timeout=2.0)
