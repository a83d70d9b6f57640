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

Sampling without a ``temperature`` is greedy (TensorRT-LLM's default when no sampling parameter is set).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trtpipe.extras import require
from trtpipe.serving.api import (
    DEFAULT_PRIORITY,
    UINT64_MAX,
    ErrorKind,
    ExecutorConfig,
    FinishReason,
    Request,
    Response,
    SamplingParams,
)
from trtpipe.serving.config import twin_default
from trtpipe.serving.executor import Executor, ExecutorStopped, QueueFullError
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


class ServedModel:
    """Tokenizer + executor over the reference runtime of one model directory."""

    def __init__(
        self, model_dir: Path, name: str, config: Optional[ExecutorConfig] = None, chat_template: Optional[str] = None
    ):
        from transformers import AutoTokenizer

        from trtpipe.runtime.hf_loader import load_hf_checkpoint
        from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

        self.dir, self.name, self.created = Path(model_dir), name, int(time.time())
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir), trust_remote_code=False)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        model = load_hf_checkpoint(self.dir)
        self.max_seq_len = int(model.config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(model.config.get("vocab_size") or len(self.tokenizer))
        self.config = config or twin_default(self.max_seq_len)
        self.eos_id = self.tokenizer.eos_token_id
        gen = self.dir / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            self.eos_id = eos[0] if isinstance(eos, list) else eos if eos is not None else self.eos_id
        # tokens >= characters / the longest token's characters: a prompt past that bound is refused untokenized
        self.max_chars_per_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="trtpipe-tokenize")
        self.executor = Executor(
            self.config, ReferenceEngine(model), threads=torch_threads(), draft_engine=draft_engine(self.config)
        )

    def refuse_long_text(self, text: str, param: str) -> None:
        """400 before tokenizing when ``text`` cannot fit the context whatever it tokenizes to: at least
        ``ceil(chars / max_chars_per_token)`` tokens (tokenizing 4 MB costs gigabytes and seconds of every
        request's time, only to be refused after)."""
        k = max(1, self.max_chars_per_token)
        least = -(-len(text) // k)
        if least >= self.max_seq_len:
            raise BadRequest(
                f"the prompt ({len(text)} characters, so at least {least} tokens: this tokenizer's longest token "
                f"has {k} characters) leaves no room in max_seq_len {self.max_seq_len}",
                param,
            )

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
        "priority",
        "user",
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
        "priority",
        "user",
        "parallel_tool_calls",
        "reasoning_effort",
    },
}
_SHARED_DEFAULTS = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "echo": (False,),
    "use_beam_search": (False,),
    "min_p": (0,),
    "top_p_min": (0,),
    "min_tokens": (0,),
    "ignore_eos": (False,),
    "include_stop_str_in_output": (False,),
    "stop_token_ids": ([],),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "length_penalty": (),
    "early_stopping": (),
    "truncate_prompt_tokens": (),
    "lora_request": (),
    "response_format": ({"type": "text"},),
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
        "tools": ([],),
        "tool_choice": ("none",),
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
    temperature = _num(body, "temperature", float, None, 0.0, 2.0)
    top_p = _num(body, "top_p", float, 1.0, 0.0, 1.0)
    top_k = _num(body, "top_k", int, 0, 0, None)
    seed = _num(body, "seed", int, None, 0, UINT64_MAX)
    if temperature is None:
        temperature = 0.0 if top_k == 0 and top_p == 1.0 else 1.0
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
    if _num(body, "n", int, 1, 1, None) != 1 or _num(body, "best_of", int, 1, 1, None) != 1:
        raise BadRequest("only n=1 (and best_of=1) is supported", "n")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise BadRequest("logprobs are not supported by this server", "logprobs")
    for key, kind in (("user", str), ("reasoning_effort", str), ("parallel_tool_calls", bool)):  # read, unused
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise BadRequest(f"'{key}' must be a {kind.__name__}", key)


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
    ):
        self.served, self.prompt, self.stops = served, prompt, stops
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
            end_id=served.eos_id,
            sampling=sampling,
            streaming=self.streamed,
            exclude_input_from_output=True,
            priority=priority,
            return_perf_metrics=True,
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
            text = self.served.tokenizer.decode(self.ids, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                text, self.stopped, self.finish = text[:cut], True, "stop"
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
                "data": [{"id": s.name, "object": "model", "created": s.created, "owned_by": "tensorrt_llm"}],
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
        if model is not None and model != self.served.name:
            raise BadRequest(f"The model `{str(model)[:200]}` does not exist.", "model")
        _check_fields(body, endpoint)
        _check_unsupported(body)
        return body

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

    def _prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a completion prompt (run off the event loop: a 1 MB prompt takes a while to encode)."""
        tok = self.served.tokenizer
        if isinstance(prompt, str):
            self.served.refuse_long_text(prompt, "prompt")
            ids = tok.encode(prompt, add_special_tokens=True)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            bad = next((t for t in prompt if not 0 <= t < self.served.vocab_size), None)
            if bad is not None:  # an id outside the vocabulary would fail the whole batched step
                raise BadRequest(
                    f"'prompt' holds token id {str(bad)[:40]}, outside the vocabulary [0, {self.served.vocab_size})",
                    "prompt",
                )
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            self.served.refuse_long_text(prompt[0], "prompt")
            ids = tok.encode(prompt[0], add_special_tokens=True)
        else:
            raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        return ids

    def _chat_ids(self, messages: Any) -> list[int]:
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
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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
        ids = await asyncio.get_running_loop().run_in_executor(
            self.served.tokenize_pool, self._prompt_ids, body.get("prompt")
        )
        max_tokens = self._max_tokens(body, len(ids), 16, "prompt")
        return await self._serve(request, body, ids, max_tokens, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "chat")
        self._refuse_early(body)
        ids = await asyncio.get_running_loop().run_in_executor(
            self.served.tokenize_pool, self._chat_ids, body.get("messages")
        )
        max_tokens = self._max_tokens(body, len(ids), None, "messages")
        return await self._serve(request, body, ids, max_tokens, chat=True)

    async def _serve(
        self, request: web.Request, body: dict, ids: list[int], max_tokens: int, chat: bool
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        stream, include_usage = _stream_settings(body)
        priority = _num(body, "priority", float, DEFAULT_PRIORITY, 0.0, 1.0)
        try:
            g = Generation(self.served, ids, max_tokens, _sampling(body), _stops(body), loop, priority, stream)
        except Refused:  # 429 / 503 at admission: a request error for trtllm_request_error_total
            self.counters.errors += 1
            raise
        self.counters.requests += 1
        self.counters.running += 1
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if stream:
                return await self._stream(request, g, rid, created, chat, include_usage)
            if not await self._finish_while_connected(request, g):
                return web.Response(status=499)  # nobody reads it: the client closed the connection
        except asyncio.CancelledError:  # client went away: free the executor slot
            g.cancel()
            raise
        finally:
            self.counters.running -= 1
            self._account(g)
        usage = self._usage(g)
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": g.text},
                "logprobs": None,
                "finish_reason": g.finish,
            }
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": self.served.name,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        choice = {"index": 0, "text": g.text, "logprobs": None, "finish_reason": g.finish}
        return web.json_response(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.served.name,
                "choices": [choice],
                "usage": usage,
            }
        )

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

    async def _stream(self, request, g: Generation, rid: str, created: int, chat: bool, include_usage: bool):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Optional[str], finish: Optional[str], first: bool = False) -> bytes:
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            payload = {"id": rid, "object": obj, "created": created, "model": self.served.name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return b"data: " + json.dumps(payload).encode() + b"\n\n"

        try:
            if chat:
                await resp.write(chunk(None, None, first=True))
            async for delta in _while_connected(request, g.deltas()):
                await resp.write(chunk(delta, None))
            await resp.write(chunk(None if chat else "", g.finish))
            if include_usage:
                payload = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.served.name,
                    "choices": [],
                    "usage": self._usage(g),
                }
                await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client left mid-stream: free its executor slot, nothing to answer
            g.cancel()
            return resp
        except asyncio.CancelledError:
            g.cancel()
            raise
        except Refused as exc:  # the status line is sent already: the error goes as the last event
            body = _error_body(exc.status, str(exc), exc.param, exc.etype)
            await resp.write(b"data: " + json.dumps({"error": body["error"]}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _usage(self, g: Generation) -> dict:
        n = g.completion_tokens
        usage = {"prompt_tokens": len(g.prompt), "completion_tokens": n, "total_tokens": len(g.prompt) + n}
        if self.served.config.speculative_decoding_type and g.perf is not None:
            usage.update(usage_extension(g.perf))
        return usage

    def _account(self, g: Generation) -> None:
        """Per-request metrics as trtllm-serve logs them (TPOT = decode time / (tokens - 1))."""
        c = self.counters
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
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def serve(
    model_dir: Path,
    host: str,
    port: int,
    name: str,
    config: Optional[ExecutorConfig] = None,
    chat_template: Optional[str] = None,
) -> None:
    """Run the server until interrupted (blocking)."""
    served = ServedModel(model_dir, name, config, chat_template)
    server = OpenAIServer(served)
    log.info("serving %s as %r on http://%s:%d (OpenAI-compatible; trtllm-serve twin)", model_dir, name, host, port)
    web.run_app(server.app, host=host, port=port, print=None, handle_signals=True, shutdown_timeout=2.0)
