"""Tool-call parsers of the OpenAI twin: a model's output text to ``content`` plus OpenAI ``tool_calls``.

Two formats, each ported from the server that defines its parser name (trtpipe/models/parsers.py):

- ``qwen3`` (Qwen2.5/Qwen3, the Hermes format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks after optional text. Port of TensorRT-LLM's ``Qwen3ToolParser.detect_and_parse``
  (``tensorrt_llm/serve/tool_parser/qwen3_tool_parser.py@674b6512`` with ``BaseToolParser.parse_base_json``,
  ``base_tool_parser.py@01bf1923``, NVIDIA/TensorRT-LLM): content is the text before the first ``<tool_call>\\n``,
  stripped; each block's JSON gives a call (``parameters`` or ``arguments``); a block that is not JSON is dropped;
  an output with no block that is itself one call's JSON is that call.
- ``llama3_json`` (Llama 3.1+): ``[<|python_tag|>]{"name": ..., "parameters": {...}}``, calls separated by ``;``,
  no end marker (ai-dynamo/dynamo ``lib/parsers/src/tool_calling/config.rs`` ``llama3_json()``: start token
  ``<|python_tag|>``, empty end token; fixture ``test_cases/fixtures/llama3_json.rs@9c29c8ec``). The whole output
  is the calls, or it is content.

Streaming (:class:`ToolCallStream`) sends content as it comes, holding back what may start a call, and sends each
call whole (name and arguments in one delta) once its block is complete; the SDK's reassembly of the deltas equals
the non-streamed message. (Upstream streams a call's arguments piecewise as partial JSON; the reassembled result is
the same.)
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("trtpipe.openai")

QWEN3_BEGIN, QWEN3_END = "<tool_call>\n", "\n</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _calls_of(obj, tool_names: set[str]) -> list[ToolCall]:
    """``parse_base_json``: a call per object with a name (a name no tool has is kept, as upstream, and logged)."""
    calls = []
    for act in obj if isinstance(obj, list) else [obj]:
        name = act.get("name") if isinstance(act, dict) else None
        if not name or not isinstance(name, str):
            continue
        if name not in tool_names:
            log.warning("the model called an undefined function: %s", name)
        args = act.get("parameters") or act.get("arguments", {})
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def parse_qwen3(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in the Qwen3/Hermes format."""
    idx = text.find(QWEN3_BEGIN)
    if idx == -1:
        try:
            calls = _calls_of(json.loads(text.strip()), tool_names)
        except (json.JSONDecodeError, AttributeError):
            calls = []
        return ("", calls) if calls else (text, [])
    calls = []
    for block in re.findall(rf"{re.escape(QWEN3_BEGIN)}(.*?){re.escape(QWEN3_END)}", text, re.DOTALL):
        try:
            calls.extend(_calls_of(json.loads(block.strip()), tool_names))
        except json.JSONDecodeError as exc:
            log.warning("a tool call that is not JSON is dropped: %s (%s)", block[:200], exc)
    return text[:idx].strip(), calls


def _json_objects(text: str) -> Optional[list]:
    """The JSON values of ``text`` separated by ``;`` (and whitespace), or None when any part is not JSON."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (out and text[i] == ";")):
            i += 1
        if i == len(text):
            return out or None
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(obj)


def parse_llama3_json(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in Llama 3's JSON format: all calls, or all content."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :]
    objs = _json_objects(body) if body.lstrip().startswith("{") else None
    calls = [c for o in objs for c in _calls_of(o, tool_names)] if objs else []
    if objs and len(calls) == len(objs):
        return "", calls
    return text, []


PARSERS = {"qwen3": parse_qwen3, "llama3_json": parse_llama3_json}


def tool_parser(name: str):
    """The whole-output parser of a tool parser name (``qwen3``, ``llama3_json``)."""
    if name not in PARSERS:
        raise ValueError(f"tool parser {name!r}: the twin runs {', '.join(PARSERS)}")
    return PARSERS[name]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (held back: the marker may follow)."""
    return max((k for k in range(1, min(len(text), len(marker) - 1) + 1) if marker.startswith(text[-k:])), default=0)


class ToolCallStream:
    """A stream's tool parsing: ``feed`` the content deltas, get (content delta, new calls); ``finish`` at the end.

    Joined, the content deltas and the calls equal :func:`parse_qwen3` / :func:`parse_llama3_json` of the whole text
    (except that a ``qwen3`` output with leading whitespace, content and then a call keeps the whitespace)."""

    def __init__(self, name: str, tool_names: set[str]):
        self.name, self.tool_names = name, tool_names
        self.text = ""  # everything fed
        self.sent = 0  # characters of text sent as content
        self.calls: list[ToolCall] = []
        self.in_calls = False  # a call has started: no more content

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        return self._qwen3() if self.name == "qwen3" else self._llama3()

    def _qwen3(self) -> tuple[str, list[ToolCall]]:
        if not self.in_calls:
            idx = self.text.find(QWEN3_BEGIN)
            if idx == -1 and self.sent == 0 and self.text.lstrip().startswith("{"):
                return "", []  # maybe a bare-JSON call (parse_qwen3's fallback): decided at the end
            if idx == -1:
                # hold back what may start a call, and the whitespace before it (content is stripped then)
                rest = self.text[: len(self.text) - _partial_suffix(self.text, QWEN3_BEGIN)]
                return self._content(len(rest.rstrip())), []
            self.in_calls = True
            content = self._content(len(self.text[:idx].rstrip()))
            return content, self._new_qwen3_calls()
        return "", self._new_qwen3_calls()

    def _new_qwen3_calls(self) -> list[ToolCall]:
        _, calls = parse_qwen3(self.text, self.tool_names)
        new = calls[len(self.calls) :]
        self.calls.extend(new)
        return new

    def _llama3(self) -> tuple[str, list[ToolCall]]:
        head = self.text.lstrip()
        if not head:
            return "", []
        if head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            self.in_calls = True  # a call (or content that looks like one): decided at the end
            return "", []
        return self._content(len(self.text)), []

    def _content(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest at the stream's end: held-back content, or the calls decided only now."""
        if self.name == "qwen3":
            if self.in_calls:
                return "", self._new_qwen3_calls()
            content, calls = parse_qwen3(self.text, self.tool_names)  # a bare-JSON call, or all content
            if calls:
                return "", calls
            return self._content(len(self.text)), []
        content, calls = parse_llama3_json(self.text, self.tool_names)
        if calls:
            return "", calls
        return self._content(len(self.text)), []
