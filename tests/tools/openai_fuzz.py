"""Fuzzing the OpenAI twin over raw HTTP: every field of ``/v1/completions`` and ``/v1/chat/completions`` given wrong
types, huge, negative and non-finite numbers, ``n``, ``logprobs``/``top_logprobs``, ``stop`` lists, ``max_tokens``,
``priority``, unknown fields, 1 MB prompts; broken JSON, bad UTF-8, deep nesting, a body over the size limit; and
clients that disconnect mid-body, mid-request and mid-stream. Each body case is sent streaming and not.

Every case must get an OpenAI-shaped error (``{"error": {"message", "type", "param", "code"}}``, a 4xx status, and
``Retry-After`` on 429/503; in a stream, an error event) or a valid answer, never a 5xx or a dropped connection;
after every case a valid greedy request must answer the expected text and ``/health`` must say 200. Run::

    python tests/tools/fuzz_serving.py MODEL_DIR_OR_LLMAPI_RECIPE [--seed 0] [--limit N]

Here: the cases (:func:`cases`) and :func:`run`, which sends them and returns a summary (cases, requests, outcomes
per endpoint and mode, ``failures``). A fixed sample runs in tests/export/test_openai_fuzz.py. The Triton
twin's campaign is :mod:`trtpipe.triton.fuzz`.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

PROMPT = "Once upon a time"
CHECK_TOKENS = 4
ISSUE_SEED = 18446744073709551616  # 2^64: killed the executor thread before it was validated
MB_PROMPT = "Once upon a time " * 61681  # 1 MB (1,048,577 characters)
NAN, INF = object(), object()  # written into the JSON text as NaN / Infinity (Python's json accepts both)


@dataclass
class Case:
    endpoint: str  # "completions" | "chat"
    what: str
    body: Any = None  # a JSON-able body (NAN / INF placeholders allowed) ...
    raw: Optional[bytes] = None  # ... or the exact bytes to send
    stream: bool = False
    action: str = "send"  # send | cut_body | leave_early | leave_mid_stream
    content_type: str = "application/json"


def base(endpoint: str, model: str) -> dict:
    if endpoint == "chat":
        return {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": CHECK_TOKENS,
            "temperature": 0,
        }
    return {"model": model, "prompt": PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0}


def encode(body: Any) -> bytes:
    """JSON text of ``body`` with the NaN/Infinity placeholders written as the bare literals."""

    def sub(v):
        if v is NAN:
            return "@@NaN@@"
        if v is INF:
            return "@@Inf@@"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(body), ensure_ascii=False)
    return text.replace('"@@NaN@@"', "NaN").replace('"@@Inf@@"', "Infinity").encode("utf-8", "surrogatepass")


GENERIC = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2,
    1.5,
    -1e30,
    1e30,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**30,
    NAN,
    INF,
    "",
    "x",
    "é€😀",
    "\ud800",
    [],
    [1],
    ["x"],
    {},
    {"a": 1},
]

SPECIFIC = {
    "max_tokens": [0, -5, 1, 3, 10**9, 2**63, "4", 4.0],
    "max_completion_tokens": [0, 1, 10**9, "4"],
    "temperature": [0.0, 0.7, 2.0, 2.5, -0.1, 1e-30],
    "top_p": [0.0, 0.5, 1.0, 1.0001, -0.5],
    "top_k": [0, 1, 5, 10**9, -3],
    "seed": [0, 7, 2**64 - 1, ISSUE_SEED, -1, 2**200],
    "n": [0, 2, 100],
    "best_of": [0, 2],
    "logprobs": [1, 5, True, 0],
    "top_logprobs": [0, 1, 20, -1],
    "stop": [[], [""], ["."], [" "], ["a"] * 100, [1], ["é"], "x" * 100_000, ["\ud800"], "there"],
    "priority": [0.0, 0.1, 0.5, 1.0, 1.1, -0.1, "high"],
    "stream_options": [{"include_usage": True}, {"include_usage": "yes"}, {"other": 1}],
    "user": ["someone", 5],
    "frequency_penalty": [0.0, 0.5],
    "response_format": [
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 4}}},
        {"type": "regex", "regex": "("},
        {"type": "ebnf"},
        {"type": "no_such_type"},
    ],
    "echo": [True, False, "yes"],
    "ignore_eos": [True, False, "yes"],
    "min_tokens": [0, 1, 4, 10**9, -1, 2**63],
    "stop_token_ids": [[], [2], [-1], [10**30], ["x"], [[2]]],
    "include_stop_str_in_output": [True, "yes"],
    "lora_request": [
        None,
        {"lora_name": "nope", "lora_int_id": 1, "lora_path": "/nonexistent"},
        {"lora_name": "x"},
        {"lora_int_id": -1},
        {"lora_path": "/etc"},
    ],
    "tools": [
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        [{"type": "function"}],
        [{"type": "other"}],
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 4}}}],
    ],
    "tool_choice": ["none", "auto", "required", {"type": "function", "function": {"name": "g"}}, {"type": "x"}],
    "parallel_tool_calls": [True, False, "yes"],
}
PROMPTS = [
    [1, 403, 407, 261, 378],
    [],
    [-1],
    [512],
    [10**30],
    [2**63],
    [[1, 2], [3]],
    ["a", "b"],
    [PROMPT],
    "",
    MB_PROMPT,
    "\x00",
    "é" * 1000,
]
MESSAGES = [
    [],
    [{}],
    [{"role": "user"}],
    [{"role": "user", "content": 123}],
    [{"role": 5, "content": "x"}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "system", "content": "x"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": MB_PROMPT}],
    "hello",
    [{"role": "user", "content": "x", "extra": {"deep": [1] * 1000}}],
]


def cases(model: str, rng: random.Random) -> list[Case]:
    out: list[Case] = []
    for ep in ("completions", "chat"):
        b = base(ep, model)
        prompt_key = "prompt" if ep == "completions" else "messages"
        fields = [
            "model",
            prompt_key,
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop",
            "n",
            "best_of",
            "logprobs",
            "priority",
            "stream_options",
            "user",
            "frequency_penalty",
            "response_format",
            "ignore_eos",
            "min_tokens",
            "stop_token_ids",
            "include_stop_str_in_output",
            "lora_request",
        ]
        if ep == "completions":
            fields += ["echo"]
        if ep == "chat":
            fields += ["max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"]
        body_cases = [
            ("valid", dict(b)),
            ("the issue's seed (temperature 1, seed 2^64)", {**b, "temperature": 1, "seed": ISSUE_SEED}),
            ("unknown field", {**b, "no_such_field": 1}),
            ("empty object", {}),
            ("model omitted", {k: v for k, v in b.items() if k != "model"}),
            (f"{prompt_key} omitted", {k: v for k, v in b.items() if k != prompt_key}),
        ]
        for name in fields:
            values = list(GENERIC) + SPECIFIC.get(name, [])
            if name == "prompt":
                values += PROMPTS
            if name == "messages":
                values += MESSAGES
            if name == "model":
                values += ["other-model", "x" * 100_000]
            for v in values:
                label = "NaN" if v is NAN else "Infinity" if v is INF else repr(v)
                if v is MB_PROMPT or (
                    isinstance(v, list) and any(isinstance(m, dict) and m.get("content") is MB_PROMPT for m in v)
                ):
                    label = "a 1 MB text"
                body_cases.append((f"{name}={label[:40]}", {**b, name: v}))
        for what, body in body_cases:
            out.append(Case(ep, what, body))
            out.append(Case(ep, what, {**body, "stream": True} if isinstance(body, dict) else body, stream=True))
        for what, raw in (
            ("empty body", b""),
            ("broken JSON", b'{"prompt": '),
            ("not an object", b"[1, 2]"),
            ("null", b"null"),
            ("a string", b'"x"'),
            ("bad UTF-8", b'{"prompt": "\xff\xfe\xfd"}'),
            ("deep nesting", b"[" * 200_000 + b"]" * 200_000),
            ("over the size limit", b'{"prompt": "' + b"a" * (5 << 20) + b'"}'),
            ("NaN temperature literal", encode({**b, "temperature": NAN})),
            ("duplicate keys", encode(b)[:-1] + b', "max_tokens": -1}'),
        ):
            out.append(Case(ep, what, raw=raw))
        out.append(Case(ep, "text/plain content type", b, content_type="text/plain"))
        out.append(Case(ep, "client cuts the body short", raw=encode(b), action="cut_body"))
        out.append(Case(ep, "client leaves before the answer", {**b, "max_tokens": 64}, action="leave_early"))
        out.append(
            Case(
                ep,
                "client leaves mid-stream",
                {**b, "max_tokens": 200, "stream": True},
                stream=True,
                action="leave_mid_stream",
            )
        )
    return out


def _shape_problem(status: int, headers: dict, data: bytes) -> str:
    """'' when an error answer is OpenAI-shaped, else what is wrong with it."""
    try:
        err = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status}, body is not an OpenAI error: {data[:200]!r}"
    if not (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and err.get("code") == status
    ):
        return f"status {status}, malformed error object {err!r:.200}"
    if status in (429, 503) and "retry-after" not in {k.lower() for k in headers}:
        return f"status {status} without Retry-After"
    return ""


def _answer_problem(case: Case, data: bytes) -> tuple[str, str]:
    """(outcome, problem) of a 200 answer."""
    if not case.stream:
        try:
            choice = json.loads(data)["choices"][0]
            text = choice["message"]["content"] if case.endpoint == "chat" else choice["text"]
        except (ValueError, KeyError, TypeError, IndexError):
            return "answer", f"200 with a malformed body {data[:200]!r}"
        return "answer", "" if isinstance(text, str) else f"200 with non-text content {text!r:.100}"
    events = [line[6:] for line in data.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "answer", f"stream not ended by [DONE]: {data[-200:]!r}"
    outcome = "answer"
    for e in events[:-1]:
        try:
            obj = json.loads(e)
        except ValueError:
            return outcome, f"stream event is not JSON: {e[:200]!r}"
        if "error" in obj:
            err = obj["error"]
            if not (isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err):
                return "error in stream", f"malformed stream error {err!r:.200}"
            outcome = "error in stream"
    return outcome, ""


class Client:
    def __init__(self, url: str, timeout: float = 300.0):
        u = urlsplit(url)
        self.host, self.port, self.timeout = u.hostname, u.port, timeout

    def request(
        self, method: str, path: str, data: Optional[bytes] = None, content_type: str = "application/json"
    ) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": content_type} if data is not None else {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def raw(self, payload: bytes, read: int = 0) -> bytes:
        """Send ``payload`` on a fresh socket, read up to ``read`` bytes, then drop the connection."""
        with socket.create_connection((self.host, self.port), timeout=self.timeout) as s:
            s.sendall(payload)
            got = b""
            while len(got) < read:
                chunk = s.recv(read - len(got))
                if not chunk:
                    break
                got += chunk
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST, not FIN
            return got


def _path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _send(client: Client, case: Case) -> tuple[str, str]:
    """(outcome, problem) of one case."""
    data = case.raw if case.raw is not None else encode(case.body)
    path = _path(case.endpoint)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data) + (100 if case.action == 'cut_body' else 0)}\r\n\r\n"
    ).encode()
    if case.action == "cut_body":
        client.raw(head + data[: len(data) // 2])
        return "client left", ""
    if case.action == "leave_early":
        client.raw(head + data)
        return "client left", ""
    if case.action == "leave_mid_stream":
        got = client.raw(head + data, read=600)
        return "client left", "" if got.startswith(b"HTTP/1.1 200") else f"stream did not start: {got[:200]!r}"
    status, headers, body = client.request("POST", path, data, case.content_type)
    if status == 200:
        return _answer_problem(case, body)
    if 400 <= status < 500:
        return f"{status}", _shape_problem(status, headers, body)
    return f"{status}", f"server error {status}: {body[:300]!r}"


def check(client: Client, model: str, expected: Optional[str]) -> tuple[str, str]:
    """(text, problem) of the valid greedy request, and /health."""
    try:
        status, _, body = client.request("POST", "/v1/completions", encode(base("completions", model)))
        text = json.loads(body)["choices"][0]["text"] if status == 200 else None
        health = client.request("GET", "/health")[0]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        return "", f"valid request failed: {type(exc).__name__}: {exc}"
    if status != 200:
        return "", f"valid request answered {status}: {body[:200]!r}"
    if health != 200:
        return text, f"/health answered {health}"
    if expected is not None and text != expected:
        return text, f"valid request answered {text!r}, expected {expected!r}"
    return text, ""


def run(
    url: str,
    model: str,
    expected: Optional[str] = None,
    limit: Optional[int] = None,
    seed: int = 0,
    alive: Optional[Callable[[], bool]] = None,
    keep: tuple[str, ...] = ("valid", "issue's seed", "leaves", "cuts", "1 MB"),
) -> dict:
    """Send the cases (a random ``limit`` of them, always with those whose description holds one of ``keep``),
    each followed by the valid greedy request; returns the summary. ``expected``: the valid request's text (None:
    the first answer is taken as it, and the summary says so)."""
    client = Client(url)
    rng = random.Random(seed)
    todo = cases(model, rng)
    total = len(todo)
    if limit is not None and len(todo) > limit:
        kept = [c for c in todo if any(k in c.what for k in keep)]
        ids = {id(c) for c in kept}
        todo = kept + rng.sample([c for c in todo if id(c) not in ids], max(0, limit - len(kept)))
    started = time.monotonic()
    text, problem = check(client, model, expected)
    failures = [f"before any case: {problem}"] if problem else []
    expected = expected if expected is not None else text
    counts: Counter = Counter()
    for case in todo:
        mode = "stream" if case.stream else "plain"
        try:
            outcome, problem = _send(client, case)
        except (OSError, http.client.HTTPException) as exc:
            outcome, problem = "connection failed", f"{type(exc).__name__}: {exc}"
        counts[f"{case.endpoint} {mode} {outcome}"] += 1
        if case.what == "valid" and outcome != "answer":
            problem = problem or f"the valid request got {outcome}"
        if problem:
            failures.append(f"{case.endpoint} {mode} [{case.what}]: {problem}")
        if alive is not None and not alive():
            failures.append(f"server died after {case.endpoint} {mode} [{case.what}]")
            break
        _, problem = check(client, model, expected)
        if problem:
            failures.append(f"after {case.endpoint} {mode} [{case.what}]: {problem}")
    return {
        "cases": len(todo),
        "of": total,
        "requests": 2 * len(todo) + 1,
        "expected": expected,
        "outcomes": dict(sorted(counts.items())),
        "failures": failures,
        "seconds": round(time.monotonic() - started, 1),
    }
