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

Streaming re-reads what has arrived, holding back a message header until its ``<|message|>`` and the possible
start of a marker, and sends what the split gained; a split of a longer text only extends the split of a shorter
one, so the pieces join to :meth:`HarmonyReasoning.parse` of the whole.
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


def split(text: str, whole: bool = True) -> ReasoningResult:
    """``reasoning_content`` and ``content`` of a harmony answer (``whole``: the answer is complete)."""
    lead, messages = _messages(text, whole)
    reasoning, content, last_text = "", lead, bool(lead)
    for m in messages:
        if m.recipient.startswith("functions."):
            constrain = f" {CONSTRAIN}{m.constrain}" if m.constrain else ""
            content += f"{CHANNEL}commentary to={m.recipient}{constrain}{MESSAGE}{m.body}"
            content += "<|call|>" if m.ended else ""
            last_text = False
        elif m.channel == "analysis" and m.body:
            reasoning += ("\n" if reasoning else "") + m.body
        elif m.channel in ("final", "commentary") and m.body:
            content += ("\n" if last_text else "") + m.body
            last_text = True
    return ReasoningResult(content=content, reasoning_content=reasoning)


def _safe_end(text: str) -> int:
    """Length of ``text`` without an ending that may be the start of a marker."""
    hold = max((k for m in MARKERS for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
    return len(text) - hold


class HarmonyReasoning:
    """The ``gpt_oss`` reasoning parser; one instance per request (a stream's state lives here)."""

    def __init__(self):
        self._text = ""
        self._sent = ReasoningResult()

    def parse(self, text: str) -> ReasoningResult:
        return split(text)

    def parse_delta(self, delta: str) -> ReasoningResult:
        self._text += delta
        return self._gain(split(self._text[: _safe_end(self._text)], whole=False))

    def finish(self) -> ReasoningResult:
        return self._gain(split(self._text))

    def _gain(self, now: ReasoningResult) -> ReasoningResult:
        """What ``now`` adds to what was sent (a split only grows; anything else is logged and not sent)."""
        out = ReasoningResult()
        for f in ("content", "reasoning_content"):
            sent, cur = getattr(self._sent, f), getattr(now, f)
            if cur.startswith(sent):
                setattr(out, f, cur[len(sent) :])
                setattr(self._sent, f, cur)
            else:
                log.warning("a streamed harmony answer's %s differs from its whole split", f)
        return out
