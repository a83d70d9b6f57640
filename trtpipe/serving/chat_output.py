"""A chat request's tools and its answer's shape: ``tools`` / ``tool_choice`` checked, and the generated text split
into ``reasoning_content``, ``content`` and ``tool_calls`` by the server's parsers, whole or as stream deltas.

The order is trtllm-serve's: the reasoning parser first (``reasoning_content`` apart), then the tool parser on what is
left, only when the request has tools and ``tool_choice`` is not ``none``. ``tool_choice`` ``required`` or a named
function constrains generation with xgrammar's structural tag of the parser's format (:func:`tool_call_grammar`),
so the text always parses into calls.
Request errors use the wording of the OpenAI-compatible servers TensorRT-LLM's protocol follows (vLLM's
``ChatCompletionRequest.check_tool_usage``); trtllm-serve's own wording for them is unconfirmed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from trtpipe.serving.reasoning import RAW_SPECIAL_TOKENS, reasoning_parser
from trtpipe.serving.tool_calls import ToolCall, ToolCallStream, new_call_id, tool_format, tool_parser


class ToolRequestError(ValueError):
    """A request's tools are wrong (HTTP 400): ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolRequest:
    """The request's function tools (as the chat template takes them) and its choice: ``none``, ``auto``,
    ``required`` or a function's name."""

    tools: list[dict]
    choice: str
    named: bool = False

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def constrained(self) -> bool:
        return self.choice == "required" or self.named


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise ToolRequestError("'tools' must be a list of function tools", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolRequestError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolRequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return tools


def tool_request(body: dict, parser: Optional[str]) -> Optional[ToolRequest]:
    """The request's tools, or None when it has none (with ``tool_choice`` ``none`` the template still renders them;
    the answer is not parsed for calls).

    Raises:
        ToolRequestError: malformed tools, a choice without tools, a named function the request lacks, or tool
            parsing asked of a server started without a tool parser.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    tools = _check_tools(tools)
    named = isinstance(choice, dict)
    if named:
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolRequestError("'tool_choice' must name a function: {'type': 'function', ...}", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise ToolRequestError(f"Tool '{name[:100]}' has not been passed in `tools`.", "tool_choice")
        choice = name
    elif choice is None:
        choice = "auto"
    elif choice not in ("none", "auto", "required"):
        raise ToolRequestError("'tool_choice' must be none, auto, required or a named function", "tool_choice")
    req = ToolRequest(tools, choice, named)
    if choice != "none" and parser is None:
        raise ToolRequestError(
            f"tool_choice {choice!r} needs a tool parser: start the server with one (trtllm-serve --tool_parser; "
            "recipe serving.tool_parser)",
            "tool_choice",
        )
    return req


def raw_special_tokens(tool: Optional[str], reasoning: Optional[str]) -> bool:
    """Whether a server with these parsers decodes chat answers with their special tokens (harmony's markers are
    special tokens of gpt-oss's vocabulary; trtllm-serve reads them from the token ids)."""
    return bool(tool and tool_format(tool).raw_special_tokens) or reasoning in RAW_SPECIAL_TOKENS


# tool parser -> xgrammar's builtin structural tag of the same output format (get_model_structural_tag; deepseekv3's
# format is DeepSeek-R1's, which xgrammar registers as deepseek_r1)
XGRAMMAR_FORMATS = {
    "qwen3": "qwen_3",
    "qwen3_coder": "qwen_3_coder",
    "kimi_k2": "kimi",
    "deepseekv3": "deepseek_r1",
    "deepseekv3.1": "deepseek_v3_1",
    "deepseek_v32": "deepseek_v3_2",
    "harmony": "harmony",
    "llama3_json": "llama",
}
MAX_WHITESPACE = 1  # consecutive whitespace inside the arguments' JSON: unbounded, a weak model can spin on it


def tool_call_grammar(parser: str, req: ToolRequest, parallel_tool_calls: bool = True) -> dict:
    """The xgrammar structural tag that makes the text calls of the allowed tools in ``parser``'s format: one call
    of the named function, or at least one call (exactly one without ``parallel_tool_calls``) for ``required``,
    each call's arguments valid against its tool's JSON schema.

    xgrammar's own builtin (``xgrammar.get_model_structural_tag``; for ``qwen_3`` the begin/end strings are those
    of TensorRT-LLM's ``Qwen3ToolParser.structure_info``: ``<tool_call>\n{"name": "NAME", "arguments": `` ...
    ``}\n</tool_call>``), without a reasoning block, with runs of whitespace in the arguments capped at
    :data:`MAX_WHITESPACE` (xgrammar's ``max_whitespace_cnt``)."""
    from xgrammar import get_model_structural_tag

    if parser not in XGRAMMAR_FORMATS:
        raise ToolRequestError(
            f"tool_choice {req.choice!r} with the {parser} tool parser is not supported", "tool_choice"
        )
    choice = {"type": "function", "function": {"name": req.choice}} if req.named else req.choice
    try:
        tag = get_model_structural_tag(
            XGRAMMAR_FORMATS[parser],
            req.tools,
            choice,
            reasoning="disabled",
            max_whitespace_cnt=MAX_WHITESPACE,
            parallel_tool_calls=parallel_tool_calls,
        )
    except ValueError as exc:  # xgrammar's own check of the tools (pydantic's ValidationError included)
        raise ToolRequestError(f"tools: {str(exc).strip().splitlines()[0]}", "tools") from None
    return _bounded(json.loads(tag.model_dump_json(exclude_none=True)))


MAX_INDEX_DIGITS = 3  # a call index's digits (Kimi-K2's ``functions.NAME:IDX``): unbounded, a weak model spins on it


def _bounded(node):
    """The tag with its unbounded ``\\d+`` patterns (Kimi-K2's call index) bounded to :data:`MAX_INDEX_DIGITS`
    digits; TensorRT-LLM's own ``KimiK2ToolParser.structure_info`` pins the index to ``0``."""
    if isinstance(node, list):
        return [_bounded(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded(v) for k, v in node.items()}
    if out.get("type") == "regex" and out.get("pattern") == r"\d+":
        out["pattern"] = rf"\d{{1,{MAX_INDEX_DIGITS}}}"
    return out


@dataclass
class ChatOutput:
    """One chat answer's parsing (a stream keeps its state here)."""

    reasoning: Optional[str]  # the server's reasoning parser name, or None
    tool: Optional[str]  # the server's tool parser name, used only when ``tools`` is set
    tools: Optional[ToolRequest]
    calls: list[ToolCall] = field(default_factory=list)
    guide: Any = None  # the executor's guide when the calls are constrained (tool_choice required or named)

    def __post_init__(self):
        self._reasoning = reasoning_parser(self.reasoning) if self.reasoning else None
        self._parse_tools = self.tools is not None and self.tools.choice != "none"
        self._stream = ToolCallStream(self.tool, self.tools.names) if self._parse_tools else None

    def message(self, text: str) -> dict:
        """The non-streamed ``message``."""
        msg: dict[str, Any] = {"role": "assistant"}
        content = text
        if self._reasoning is not None:
            split = self._reasoning.parse(text)
            content, msg["reasoning_content"] = split.content, split.reasoning_content or None
        if self._parse_tools:
            content, self.calls = tool_parser(self.tool)(content, self.tools.names)
        msg["content"] = content if content or not self.calls else None
        if self.calls:
            msg["tool_calls"] = [c.openai(new_call_id()) for c in self.calls]
        return msg

    def feed(self, delta: str) -> list[dict]:
        """The stream deltas of the next piece of text."""
        if self._reasoning is None:
            return self._content(delta)
        split = self._reasoning.parse_delta(delta)
        out = [{"reasoning_content": split.reasoning_content}] if split.reasoning_content else []
        return out + self._content(split.content)

    def finish(self) -> list[dict]:
        """The deltas held back until the end."""
        out = []
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out = ([{"reasoning_content": split.reasoning_content}] if split.reasoning_content else []) + self._content(
                split.content
            )
        if self._stream is not None:
            content, calls = self._stream.finish()
            out += self._deltas(content, calls)
        return out

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        if self._stream is None:
            return [{"content": text}]
        return self._deltas(*self._stream.feed(text))

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        for call in calls:
            index = len(self.calls)
            self.calls.append(call)
            out.append({"tool_calls": [{"index": index, **call.openai(new_call_id())}]})
        return out

    def finish_reason(self, finish: Optional[str]) -> Optional[str]:
        return "tool_calls" if self.calls and finish == "stop" else finish
