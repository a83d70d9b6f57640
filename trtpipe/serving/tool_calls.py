"""Tool-call parsers of the OpenAI twin: a model's output text to ``content`` plus OpenAI ``tool_calls``.

One :class:`ToolFormat` row per parser name in :data:`FORMATS` (trtpipe/models/parsers.py names them): a
whole-output ``parse`` ported from the server that defines the name, and the markers the one generic
:class:`ToolCallStream` needs to stream it. Ports, each at the file@commit read (NVIDIA/TensorRT-LLM unless said):

- ``qwen3`` (Qwen2.5/Qwen3, the Hermes format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  blocks after optional text. ``Qwen3ToolParser.detect_and_parse`` (``tensorrt_llm/serve/tool_parser/
  qwen3_tool_parser.py@674b6512`` with ``BaseToolParser.parse_base_json``, ``base_tool_parser.py@01bf1923``):
  content is the text before the first ``<tool_call>\\n``, stripped; each block's JSON gives a call (``parameters``
  or ``arguments``); a block that is not JSON is dropped; an output with no block that is itself one call's JSON is
  that call.
- ``qwen3_coder`` (Qwen3-Coder's XML form): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>
  ...</function>\\n</tool_call>``. ``Qwen3CoderToolParser._extract`` / ``_parse_block`` / ``_safe_val``
  (``qwen3_coder_parser.py@02499765``): content is all text outside complete blocks (an unterminated block stays
  content); each parameter value is JSON, else a Python literal, else the string, after HTML unescaping and with
  one leading and trailing newline run dropped.
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {json}<|tool_call_end|>...<|tool_calls_section_end|>``. ``KimiK2ToolParser.detect_and_parse``
  (``kimi_k2_tool_parser.py@65b31db1``): no section marker, all content; else content is the text before it, and
  each call whose JSON object matches the call regex and whose name is a request's tool is kept (others dropped).
- ``deepseekv3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{json}\\n```
  <｜tool▁call▁end｜>...``. ``DeepSeekV3Parser.detect_and_parse`` (``deepseekv3_parser.py@205f8c25``): content is
  the text before the section marker, stripped; a call whose JSON does not parse fails them all: the whole text is
  then content, with no calls.
- ``deepseekv3.1``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...``.
  ``DeepSeekV31Parser.detect_and_parse`` (``deepseekv31_parser.py@1262edbc``): as ``deepseekv3``, without the
  ``function`` prefix and the JSON code fence.
- ``deepseek_v32`` (DeepSeek-V3.2's DSML): ``<｜DSML｜function_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter
  name="KEY" string="true|false">VALUE</｜DSML｜parameter>...</｜DSML｜invoke></｜DSML｜function_calls>``, or a JSON
  object as the invoke's body. ``DeepSeekV32Parser.detect_and_parse`` (``deepseekv32_parser.py@0c8de69a``):
  content is the text before the section, stripped; only the first complete section is read; a ``string="true"``
  value is the stripped text, any other JSON (else the text).
- ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}<|call|>``, the
  form Dynamo's ``harmony`` parser reads (ai-dynamo/dynamo ``lib/parsers/src/tool_calling/test_cases/fixtures/
  harmony.rs@9c29c8ec``) and the gpt_oss reasoning parser (:mod:`trtpipe.serving.harmony`) hands on. A call is
  kept when the request has that tool, as trtllm-serve's ``HarmonyStreamState`` filters
  (``tensorrt_llm/serve/harmony_adapter.py@02238b67``); the arguments are the message as generated.
- ``llama3_json`` (Llama 3.1+): ``[<|python_tag|>]{"name": ..., "parameters": {...}}``, calls separated by ``;``,
  no end marker (ai-dynamo/dynamo ``lib/parsers/src/tool_calling/config.rs`` ``llama3_json()``: start token
  ``<|python_tag|>``, empty end token; fixture ``test_cases/fixtures/llama3_json.rs@9c29c8ec``). The whole output
  is the calls, or it is content.

Undefined functions: ``parse_base_json`` at ``base_tool_parser.py@01bf1923`` keeps a call to a function no tool
has (and logs it), so ``qwen3``, ``qwen3_coder`` and the three DeepSeek formats keep it; ``kimi_k2`` drops it in its own code.
UNCONFIRMED for the 1.2 release: upstream's test file of the same parsers (``tests/unittest/llmapi/apps/
test_tool_parsers.py``, the revision whose imports match ``tool_parser_factory.py@34eff6ae``) expects such calls
dropped by every parser, so 1.2's ``parse_base_json`` may drop them.

Streaming (:class:`ToolCallStream`) sends content as it comes, holding back what may start a call (and, for a
format whose content is stripped, trailing whitespace), and sends each call whole (name and arguments in one delta)
once its end marker has arrived, or at the end for a format without one; the SDK's reassembly of the deltas equals
the non-streamed message. (Upstream streams a call's arguments piecewise as partial JSON; the reassembled result is
the same.) Known difference: a stripped format's output with leading whitespace, then content, then a call keeps
the leading whitespace when streamed.
"""

from __future__ import annotations

import ast
import html
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

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


# --- qwen3 -------------------------------------------------------------------------------------------------------


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


# --- qwen3_coder -------------------------------------------------------------------------------------------------

CODER_BEGIN, CODER_END = "<tool_call>", "</tool_call>"
_CODER_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)


def _safe_val(raw: str):
    """A parameter's value: JSON, else a Python literal, else the (HTML-unescaped, stripped) string."""
    raw = html.unescape(raw.strip())
    try:
        return json.loads(raw)
    except ValueError:
        try:
            return ast.literal_eval(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw


def _coder_block(block: str, tool_names: set[str]) -> list[ToolCall]:
    calls = []
    for m in _CODER_FUNCTION.findall(block):
        txt = m[0] or m[1]
        if ">" not in txt:
            continue
        name, body = txt[: txt.index(">")].strip(), txt[txt.index(">") + 1 :]
        params = {}
        for pm in _CODER_PARAMETER.findall(body):
            ptxt = pm[0] or pm[1]
            if ">" not in ptxt:
                continue
            pidx = ptxt.index(">")
            params[ptxt[:pidx].strip()] = _safe_val(ptxt[pidx + 1 :].lstrip("\n").rstrip("\n"))
        try:
            calls.extend(_calls_of({"name": name, "arguments": params}, tool_names))
        except (TypeError, ValueError):  # json.dumps of a literal JSON cannot hold (a set, bytes, ...)
            log.warning("invalid tool call for %s dropped", name)
    return calls


def parse_qwen3_coder(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in Qwen3-Coder's XML format: content is everything outside the blocks."""
    normal, calls, cursor = [], [], 0
    while True:
        s = text.find(CODER_BEGIN, cursor)
        if s == -1:
            normal.append(text[cursor:])
            break
        normal.append(text[cursor:s])
        e = text.find(CODER_END, s)
        if e == -1:
            normal.append(text[s:])
            break
        cursor = e + len(CODER_END)
        calls.extend(_coder_block(text[s:cursor], tool_names))
    return "".join(normal), calls


# --- kimi_k2 -----------------------------------------------------------------------------------------------------

KIMI_BEGIN, KIMI_CALL_END = "<|tool_calls_section_begin|>", "<|tool_call_end|>"
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<tool_call_id>[\w\.]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
    r"(?P<function_arguments>\{.*?\})\s*<\|tool_call_end\|>"
)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w\.]+):(?P<index>\d+)$")


def parse_kimi_k2(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in Kimi-K2's format; calls of functions the request lacks are dropped."""
    if KIMI_BEGIN not in text:
        return text, []
    calls = []
    for call_id, args in _KIMI_CALL.findall(text):
        m = _KIMI_ID.match(call_id)
        if not m:
            log.warning("unexpected tool_call_id format: %s", call_id)
            continue
        if m.group("name") not in tool_names:
            log.warning("the model called an undefined function: %s", m.group("name"))
            continue
        calls.append(ToolCall(m.group("name"), args))
    return text[: text.find(KIMI_BEGIN)], calls


# --- deepseekv3 --------------------------------------------------------------------------------------------------

DSV3_BEGIN, DSV3_CALL_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁end｜>"
_DSV3_CALL = re.compile(r"<｜tool▁call▁begin｜>.*?<｜tool▁call▁end｜>", re.DOTALL)
_DSV3_DETAIL = re.compile(
    r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)\n```json\n(.*)\n```<｜tool▁call▁end｜>", re.DOTALL
)


def parse_deepseekv3(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in DeepSeek-V3's format: one bad call makes it all content."""
    idx = text.find(DSV3_BEGIN)
    if idx == -1:
        return text, []
    calls = []
    for block in _DSV3_CALL.findall(text):
        detail = _DSV3_DETAIL.search(block)
        try:
            args = json.loads(detail.group(3)) if detail else None
        except json.JSONDecodeError:
            args = None
        if detail is None or args is None:
            log.warning("a DeepSeek-V3 tool call does not parse: the output is content (%s)", block[:200])
            return text, []
        calls.extend(_calls_of({"name": detail.group(2), "parameters": args}, tool_names))
    return text[:idx].strip(), calls


# --- deepseekv3.1 ------------------------------------------------------------------------------------------------

_DSV31_DETAIL = re.compile(r"<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>", re.DOTALL)


def parse_deepseekv31(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in DeepSeek-V3.1's format: one bad call makes it all content."""
    idx = text.find(DSV3_BEGIN)
    if idx == -1:
        return text, []
    calls = []
    for block in _DSV3_CALL.findall(text):
        detail = _DSV31_DETAIL.search(block)
        try:
            args = json.loads(detail.group(2)) if detail else None
        except json.JSONDecodeError:
            args = None
        if detail is None or args is None:
            log.warning("a DeepSeek-V3.1 tool call does not parse: the output is content (%s)", block[:200])
            return text, []
        calls.extend(_calls_of({"name": detail.group(1), "parameters": args}, tool_names))
    return text[:idx].strip(), calls


# --- deepseek_v32 ------------------------------------------------------------------------------------------------

DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
_DSML_SECTION = re.compile(r"<｜DSML｜function_calls>(.*?)</｜DSML｜function_calls>", re.DOTALL)
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke\s+name="([^"]+)"\s*>(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]+)"\s+string="([^"]+)"\s*>(.*?)</｜DSML｜parameter>', re.DOTALL
)


def _dsml_parameters(body: str) -> dict:
    """An invoke's arguments: its body as a JSON object, else its parameter tags."""
    stripped = body.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            params = json.loads(stripped)
            if isinstance(params, dict):
                return params
        except ValueError:
            pass
    params = {}
    for name, is_string, value in _DSML_PARAMETER.findall(body):
        if is_string == "true":
            params[name] = value.strip()
            continue
        try:
            params[name] = json.loads(value.strip())
        except ValueError:
            params[name] = value.strip()
    return params


def parse_deepseek_v32(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output in DeepSeek-V3.2's DSML format."""
    idx = text.find(DSML_BEGIN)
    if idx == -1:
        return text, []
    section = _DSML_SECTION.search(text)
    calls = []
    for name, body in _DSML_INVOKE.findall(section.group(1)) if section else []:
        calls.extend(_calls_of({"name": name, "parameters": _dsml_parameters(body)}, tool_names))
    return text[:idx].strip(), calls


# --- harmony -----------------------------------------------------------------------------------------------------

HARMONY_BEGIN, HARMONY_CALL = "<|channel|>commentary to=functions.", "<|call|>"
_HARMONY_CALL = re.compile(
    r"<\|channel\|>commentary to=functions\.([^\s<]+)\s*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)<\|call\|>",
    re.DOTALL,
)


def parse_harmony(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of the gpt_oss reasoning parser's output: each call message is a call of a request's tool
    (others dropped); content is the rest."""
    calls = []
    for name, args in _HARMONY_CALL.findall(text):
        if name in tool_names:
            calls.append(ToolCall(name, args))
        else:
            log.warning("the model called an undefined function: %s", name)
    return _HARMONY_CALL.sub("", text), calls


# --- llama3_json -------------------------------------------------------------------------------------------------


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


def _llama3_holds(text: str) -> bool:
    head = text.lstrip()
    return not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head)


def _bare_json_holds(text: str) -> bool:
    return text.lstrip().startswith("{")


# --- the table ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """A tool parser: its whole-output ``parse`` and what streaming it needs.

    ``begin``: markers where the calls start (the content before them is content). ``call_end``: the marker after
    which a call is whole (None: calls are sent at the end, for a format where a later call can undo earlier ones).
    ``strip``: content before the calls is stripped. ``holds``: the text so far may be a call without a marker:
    nothing is sent until it is not, or until the end. ``raw_special_tokens``: the markers are special tokens, so
    the answer is decoded with them (upstream's ``BaseToolParser.needs_raw_special_tokens``)."""

    parse: Callable[[str, set[str]], tuple[str, list[ToolCall]]]
    begin: tuple[str, ...] = ()
    call_end: Optional[str] = None
    strip: bool = False
    holds: Callable[[str], bool] = lambda text: False
    raw_special_tokens: bool = False
    # the text after a call's end marker up to a later one parses alone into the calls it adds, once prefixed with
    # ``segment`` (None: only the whole text so far parses, as for a format that reads its first section only)
    segment: Optional[str] = None


FORMATS: dict[str, ToolFormat] = {
    "qwen3": ToolFormat(parse_qwen3, (QWEN3_BEGIN,), QWEN3_END, strip=True, holds=_bare_json_holds, segment=""),
    "qwen3_coder": ToolFormat(parse_qwen3_coder, (CODER_BEGIN,), CODER_END, segment=""),
    "kimi_k2": ToolFormat(parse_kimi_k2, (KIMI_BEGIN,), KIMI_CALL_END, segment=KIMI_BEGIN),
    "deepseekv3": ToolFormat(parse_deepseekv3, (DSV3_BEGIN,), None, strip=True),
    "deepseekv3.1": ToolFormat(parse_deepseekv31, (DSV3_BEGIN,), None, strip=True),
    "deepseek_v32": ToolFormat(parse_deepseek_v32, (DSML_BEGIN,), DSML_END, strip=True),
    "harmony": ToolFormat(parse_harmony, (HARMONY_BEGIN,), HARMONY_CALL, raw_special_tokens=True, segment=""),
    "llama3_json": ToolFormat(parse_llama3_json, holds=_llama3_holds),
}


def tool_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise ValueError(f"tool parser {name!r}: the twin runs {', '.join(FORMATS)}")
    return FORMATS[name]


def tool_parser(name: str):
    """The whole-output parser of a tool parser name."""
    return tool_format(name).parse


def _rstripped(text: str, upto: int) -> int:
    """Length of ``text[:upto].rstrip()``, without copying the text."""
    while upto > 0 and text[upto - 1].isspace():
        upto -= 1
    return upto


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that ``marker`` starts with (held back: the marker may follow)."""
    return max((k for k in range(1, min(len(text), len(marker) - 1) + 1) if marker.startswith(text[-k:])), default=0)


class ToolCallStream:
    """A stream's tool parsing: ``feed`` the content deltas, get (content delta, new calls); ``finish`` at the end.

    Joined, the content deltas and the calls equal the format's ``parse`` of the whole text (see the module's
    known difference)."""

    def __init__(self, name: str, tool_names: set[str]):
        self.format, self.tool_names = tool_format(name), tool_names
        self.text = ""  # everything fed
        self.sent = 0  # characters of text sent as content
        self.calls: list[ToolCall] = []
        self.in_calls = False  # a call has started: content is decided at the end
        self.parsed = 0  # the text up to here (after a call's end marker) gave self.calls
        self._longest = max((len(b) for b in self.format.begin), default=0)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Linear in the text: each piece is searched where a marker can newly be (the last marker's length back),
        and the calls are parsed when an end marker arrives, from the previous call's end where the format allows
        (``ToolFormat.segment``)."""
        old = len(self.text)
        self.text += delta
        if self.in_calls:
            return "", self._new_calls(old)
        fmt, text = self.format, self.text
        lo = max(0, old - self._longest + 1)  # a marker starting before lo lay whole in the text already searched
        starts = [i for i in (text.find(b, lo) for b in fmt.begin) if i >= 0]
        if not starts:
            if self.sent == 0 and fmt.holds(text):
                return "", []
            keep = len(text) - max((_partial_suffix(text, b) for b in fmt.begin), default=0)
            return self._content(_rstripped(text, keep) if fmt.strip else keep), []
        self.in_calls, idx = True, min(starts)
        content = self._content(_rstripped(text, idx) if fmt.strip else idx)
        return content, self._new_calls(idx)

    def _new_calls(self, old: int) -> list[ToolCall]:
        """The calls complete so far (parsed up to the last end marker) that were not sent; ``old``: the length of
        the text before this piece (an end marker that ends before it was parsed already)."""
        end_marker = self.format.call_end
        if not end_marker:
            return []
        end = self.text.rfind(end_marker, max(self.parsed, old - len(end_marker) + 1))
        if end == -1:
            return []
        upto = end + len(end_marker)
        if self.format.segment is None:  # the whole text so far
            _, calls = self.format.parse(self.text[:upto], self.tool_names)
            new = calls[len(self.calls) :]
        else:
            _, new = self.format.parse(self.format.segment + self.text[self.parsed : upto], self.tool_names)
        self.parsed = upto
        self.calls.extend(new)
        return new

    def _content(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : upto], upto
        return delta

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest at the stream's end: held-back content, and the calls decided only now."""
        content, calls = self.format.parse(self.text, self.tool_names)
        head = self.text[: self.sent]
        if not content.startswith(head):  # cannot be taken back (the module's known difference)
            log.warning("a streamed answer's content differs from its whole parse")
        rest = content[len(head) :] if content.startswith(head) else ""
        new = calls[len(self.calls) :]
        self.calls.extend(new)
        return rest, new
