"""gpt-oss's harmony output split into ``reasoning_content`` and ``content``: the ``gpt_oss`` reasoning parser.

A gpt-oss answer is a run of harmony messages (the generation prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>

A port of Dynamo's ``GptOssReasoningParser`` (ai-dynamo/dynamo ``lib/parsers/src/reasoning/gpt_oss_parser.rs
@0f70f478``, which reads the same messages with the ``openai_harmony`` crate): the ``analysis`` channel is reasoning,
``final`` and ``commentary`` are content, each message's text joined to the one before by a newline; a message to a
function (``to=functions.NAME``) is handed on as its call text, ``<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>ARGS<|call|>`` (the form Dynamo's parser rebuilds for its ``harmony`` tool parser),
which :mod:`trtpipe.serving.tool_calls`' ``harmony`` format turns into ``tool_calls``. trtllm-serve does the same
split for a gpt-oss model in ``tensorrt_llm/serve/harmony_adapter.py@02238b67`` (analysis -> reasoning, final and
commentary preambles -> content, commentary to functions -> tool calls), on token ids.

Text that is no harmony message at all is content. The markers are special tokens of gpt-oss's vocabulary, so the
answer must be decoded with them (the parser row's ``raw_special_tokens``: trtpipe/models/parsers.py).

Streaming reads each piece once (:class:`HarmonyReasoning`), holding back a message header until its
``<|message|>`` and the possible start of a marker, and sends what the open message's body gained, joined as
:func:`split` joins; a split of a longer text only extends the split of a shorter one, so the pieces join to
:meth:`HarmonyReasoning.parse` of the whole.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from trtpipe.serving.reasoning_result import ReasoningResult

log = logging.getLogger("trtpipe.openai")

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *ENDS)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CONSTRAIN = re.compile(r"<\|constrain\|>\s*([^\s<]+)")


@dataclass
class _Message:
    channel: str
    recipient: str
    constrain: str
    body: str
    ended: bool  # its end marker arrived (or the whole answer did)


def _messages(text: str, whole: bool) -> tuple[str, list[_Message]]:
    """(text before the first message that is no harmony, the messages); an unfinished header at the end is
    dropped (a stream waits for it), or kept as text when it holds no marker and ``whole``."""
    out, pos, lead = [], 0, ""
    while pos < len(text):
        head_end = text.find(MESSAGE, pos)
        if head_end == -1:
            rest = text[pos:]
            if not out and whole and not any(m in rest for m in MARKERS):
                lead = rest
            break
        header, body_at = text[pos:head_end], head_end + len(MESSAGE)
        ends = [(i, m) for m in ENDS for i in (text.find(m, body_at),) if i >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        channel, recipient, constrain = (
            (m.group(1) if m else "")
            for m in (_CHANNEL.search(header), _RECIPIENT.search(header), _CONSTRAIN.search(header))
        )
        out.append(_Message(channel, recipient, constrain, text[body_at:end], bool(marker) or whole))
        pos = end + len(marker)
        if not marker:
            break
    return lead, out


@dataclass
class _Fold:
    """What joining the next message depends on: whether reasoning has text, whether the content ends in text."""

    has_reasoning: bool = False
    last_text: bool = False


def _function_head(m: _Message) -> str:
    constrain = f" {CONSTRAIN}{m.constrain}" if m.constrain else ""
    return f"{CHANNEL}commentary to={m.recipient}{constrain}{MESSAGE}"


def _add(m: _Message, f: _Fold) -> tuple[str, str]:
    """(reasoning, content) that message ``m`` adds after the messages folded into ``f`` (which it updates)."""
    if m.recipient.startswith("functions."):
        f.last_text = False
        return "", _function_head(m) + m.body + ("<|call|>" if m.ended else "")
    if m.channel == "analysis" and m.body:
        sep, f.has_reasoning = "\n" if f.has_reasoning else "", True
        return sep + m.body, ""
    if m.channel in ("final", "commentary") and m.body:
        sep, f.last_text = "\n" if f.last_text else "", True
        return "", sep + m.body
    return "", ""


def split(text: str, whole: bool = True) -> ReasoningResult:
    """``reasoning_content`` and ``content`` of a harmony answer (``whole``: the answer is complete)."""
    lead, messages = _messages(text, whole)
    fold, reasoning, content = _Fold(last_text=bool(lead)), [], [lead]
    for m in messages:
        r, c = _add(m, fold)
        reasoning.append(r)
        content.append(c)
    return ReasoningResult(content="".join(content), reasoning_content="".join(reasoning))


def _safe_end(text: str) -> int:
    """Length of ``text`` without an ending that may be the start of a marker."""
    hold = max((k for m in MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
    return len(text) - hold


class HarmonyReasoning:
    """The ``gpt_oss`` reasoning parser; one instance per request (a stream's state lives here).

    A stream reads each piece once: the open message's header is looked for, then its end markers, only where they
    can newly be, and what its body gained is sent, joined to the messages before as :func:`split` joins them (the
    same :func:`_add`), so the pieces join to ``split`` of the text up to the held-back end."""

    _LONGEST_END = max(len(m) for m in ENDS)

    def __init__(self):
        self._text = ""
        self._fold = _Fold()  # the messages whose bodies were sent, as far as the joining goes
        self._pos = 0  # where the open message's header starts
        self._scan = 0  # the text before this was searched (for the header, then for the body's end)
        self._open = None  # the open message (its header complete), or None
        self._body_at = 0  # where the open message's body starts
        self._body_sent = 0  # characters of its body sent
        self._sent = {"content": [], "reasoning_content": []}

    def parse(self, text: str) -> ReasoningResult:
        return split(text)

    def parse_delta(self, delta: str) -> ReasoningResult:
        self._text += delta
        text, safe = self._text, _safe_end(self._text)
        reasoning, content = [], []
        while True:
            if self._open is None:
                head_end = text.find(MESSAGE, max(self._pos, self._scan - len(MESSAGE) + 1), safe)
                if head_end == -1:
                    self._scan = max(self._scan, safe)
                    break
                header = text[self._pos : head_end]
                self._open = _Message(
                    *(
                        (m.group(1) if m else "")
                        for m in (_CHANNEL.search(header), _RECIPIENT.search(header), _CONSTRAIN.search(header))
                    ),
                    body="",
                    ended=False,
                )
                self._body_at = self._scan = head_end + len(MESSAGE)
                self._body_sent = 0
                if self._open.recipient.startswith("functions."):
                    content.append(_function_head(self._open))
                    self._fold.last_text = False
            ends = [(i, m) for m in ENDS for i in (text.find(m, max(self._body_at, self._scan - len(m) + 1), safe),)]
            ends = [(i, m) for i, m in ends if i >= 0]
            end, marker = min(ends) if ends else (safe, "")
            self._scan = max(self._scan, end)
            r, c = self._body(text[self._body_at + self._body_sent : end])
            reasoning.append(r)
            content.append(c)
            if not marker:
                break
            if self._open.recipient.startswith("functions."):
                content.append("<|call|>")
            self._open, self._pos = None, end + len(marker)
            self._scan = self._pos
        return self._record(ReasoningResult(content="".join(content), reasoning_content="".join(reasoning)))

    def _body(self, more: str) -> tuple[str, str]:
        """(reasoning, content) that ``more`` of the open message's body adds."""
        if not more:
            return "", ""
        m, first = self._open, self._body_sent == 0
        self._body_sent += len(more)
        if m.recipient.startswith("functions."):
            return "", more
        if m.channel == "analysis":
            sep = "\n" if first and self._fold.has_reasoning else ""
            self._fold.has_reasoning = True
            return sep + more, ""
        if m.channel in ("final", "commentary"):
            sep = "\n" if first and self._fold.last_text else ""
            self._fold.last_text = True
            return "", sep + more
        return "", ""

    def _record(self, out: ReasoningResult) -> ReasoningResult:
        for f in ("content", "reasoning_content"):
            if getattr(out, f):
                self._sent[f].append(getattr(out, f))
        return out

    def finish(self) -> ReasoningResult:
        """What the whole text's split adds to what was sent (a split only grows; anything else is logged and not
        sent): the held-back end, an unfinished call's ``<|call|>``, text that is no harmony at all."""
        now, out = split(self._text), ReasoningResult()
        for f in ("content", "reasoning_content"):
            sent, cur = "".join(self._sent[f]), getattr(now, f)
            if cur.startswith(sent):
                setattr(out, f, cur[len(sent) :])
            else:
                log.warning("a streamed harmony answer's %s differs from its whole split", f)
        return self._record(out)
