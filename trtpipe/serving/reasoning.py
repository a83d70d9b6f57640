"""Reasoning parsers of the OpenAI twin: split a model's output into ``reasoning_content`` and ``content``.

A port of TensorRT-LLM's ``DeepSeekR1Parser`` (``tensorrt_llm/llmapi/reasoning_parser.py@033a9d09``,
NVIDIA/TensorRT-LLM), which trtllm-serve registers as ``deepseek-r1`` (``reasoning_at_start=True``: DeepSeek-R1's
chat template ends the prompt with ``<think>\\n``, so everything before ``</think>`` is reasoning) and as ``qwen3``
(``reasoning_at_start=False``: reasoning only inside ``<think>...</think>``; text before ``<think>`` is dropped, as
upstream drops it). ``parse`` takes a whole output, ``parse_delta`` the stream's pieces in order, ``finish`` flushes
what a stream held back (a possible start of a tag) at its end; the pieces join to what ``parse`` gives.

:data:`PARSERS` is the table of every name the twin runs, ``gpt_oss`` (gpt-oss's harmony channels) included:
:mod:`trtpipe.serving.harmony`.
"""

from __future__ import annotations

from trtpipe.serving.harmony import HarmonyReasoning
from trtpipe.serving.reasoning_result import ReasoningResult

THINK_START, THINK_END = "<think>", "</think>"

# trtllm-serve name -> reasoning_at_start (@register_reasoning_parser keys of DeepSeekR1Parser)
REASONING_AT_START = {"deepseek-r1": True, "qwen3": False}


class ThinkParser:
    """``<think>(reasoning)</think>(content)``; one instance per request (a stream's state lives here)."""

    def __init__(self, reasoning_at_start: bool):
        self.reasoning_at_start = reasoning_at_start
        self.in_reasoning = reasoning_at_start
        self._buffer = ""

    def parse(self, text: str) -> ReasoningResult:
        if not self.reasoning_at_start:
            before, tag, after = text.partition(THINK_START)
            if not tag:
                return ReasoningResult(content=text)
            text = after  # text before the start tag is dropped (as upstream)
        reasoning, _, content = text.partition(THINK_END)
        return ReasoningResult(content=content, reasoning_content=reasoning)

    def parse_delta(self, delta: str) -> ReasoningResult:
        self._buffer += delta
        text = self._buffer
        if THINK_START.startswith(text) or THINK_END.startswith(text):
            return ReasoningResult()  # a tag may be starting: wait for more
        reasoning = None
        if not self.in_reasoning:
            begin = text.find(THINK_START)
            if begin == -1:
                self._buffer = ""
                return ReasoningResult(content=text)
            self.in_reasoning = True
            reasoning = text[begin + len(THINK_START) :]
        text = reasoning if reasoning is not None else text
        end = text.find(THINK_END)
        if end == -1:
            last = text.rfind(THINK_END[0])
            if last != -1 and THINK_END.startswith(text[last:]):
                self._buffer = text[last:]
                return ReasoningResult(reasoning_content=text[:last])
            self._buffer = ""
            return ReasoningResult(reasoning_content=text)
        self.in_reasoning = False
        self._buffer = ""
        return ReasoningResult(content=text[end + len(THINK_END) :], reasoning_content=text[:end])

    def finish(self) -> ReasoningResult:
        """What ``parse_delta`` held back, attributed to the block it was held in (a whole tag is dropped)."""
        rest, self._buffer = self._buffer, ""
        if not rest or rest in (THINK_START, THINK_END):
            return ReasoningResult()
        return ReasoningResult(reasoning_content=rest) if self.in_reasoning else ReasoningResult(content=rest)


# name -> a fresh parser for one request
PARSERS = {
    **{name: (lambda at_start=at_start: ThinkParser(at_start)) for name, at_start in REASONING_AT_START.items()},
    "gpt_oss": HarmonyReasoning,
}
RAW_SPECIAL_TOKENS = frozenset({"gpt_oss"})  # parsers whose markers are special tokens: the answer keeps them


def reasoning_parser(name: str):
    """A fresh parser for one request, by its name (trtllm-serve's where it has one)."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser {name!r}: the twin runs {', '.join(PARSERS)}")
    return PARSERS[name]()
