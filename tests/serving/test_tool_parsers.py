"""The twin's tool and reasoning parsers on upstream-format texts, against the output upstream's own tests expect.

Qwen3 cases are TensorRT-LLM's (``TestQwen3ToolParser`` in ``tests/unittest/llmapi/apps/test_tool_parsers.py``,
NVIDIA/TensorRT-LLM); the Llama 3 case is Dynamo's ``llama3_json`` fixture shape
(``lib/parsers/src/tool_calling/test_cases/fixtures/llama3_json.rs@9c29c8ec``) and the parameters form Llama 3.1's
chat template asks for; the reasoning cases follow ``DeepSeekR1Parser``'s documented split. Streaming is checked
by feeding every split of the text into pieces and joining what comes out: it must equal the whole-text parse.
"""

from __future__ import annotations

import json
import random

import pytest

from trtpipe.serving.reasoning import reasoning_parser
from trtpipe.serving.tool_calls import ToolCallStream, tool_parser

TOOLS = {"get_weather", "search_web"}


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


QWEN3_CASES = [
    (  # detect_and_parse_single_tool
        'Normal text\n<tool_call>\n{"name":"get_weather","arguments":{"location":"NYC"}}\n</tool_call>',
        "Normal text",
        [("get_weather", {"location": "NYC"})],
    ),
    (  # detect_and_parse_multiple_tools
        '<tool_call>\n{"name":"get_weather","arguments":{"location":"LA"}}\n</tool_call>\n'
        '<tool_call>\n{"name":"search_web","arguments":{"query":"AI"}}\n</tool_call>',
        "",
        [("get_weather", {"location": "LA"}), ("search_web", {"query": "AI"})],
    ),
    (  # detect_and_parse_malformed_tool: dropped
        '<tool_call>\n{"name":"get_weather","arguments":MALFORMED}\n</tool_call>',
        "",
        [],
    ),
    (  # detect_and_parse_with_parameters_key
        '<tool_call>\n{"name":"search_web","parameters":{"query":"test"}}\n</tool_call>',
        "",
        [("search_web", {"query": "test"})],
    ),
    (  # undefined_tool: kept (BaseToolParser.parse_base_json only warns)
        '<tool_call>\n{"name":"undefined_func","arguments":{}}\n</tool_call>',
        "",
        [("undefined_func", {})],
    ),
    ("Just some regular text without tool calls", "Just some regular text without tool calls", []),
    ('{"name": "get_weather", "arguments": {"location": "Oslo"}}', "", [("get_weather", {"location": "Oslo"})]),
]

LLAMA3_CASES = [
    (
        '<|python_tag|>{"name":"get_weather","arguments":{"location":"Paris"}}',
        "",
        [("get_weather", {"location": "Paris"})],
    ),
    (
        '{"name": "get_weather", "parameters": {"location": "Rome"}}; '
        '{"name": "search_web", "parameters": {"query": "x"}}',
        "",
        [("get_weather", {"location": "Rome"}), ("search_web", {"query": "x"})],
    ),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
]


def streamed(name: str, text: str, rng: random.Random):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s, content, calls = ToolCallStream(name, TOOLS), "", []
    for p in pieces:
        c, new = s.feed(p)
        content, calls = content + c, calls + new
    c, new = s.finish()
    return content + c, calls + new


@pytest.mark.parametrize("name, cases", [("qwen3", QWEN3_CASES), ("llama3_json", LLAMA3_CASES)])
def test_tool_parsers_give_upstreams_expected_output(name, cases):
    parse = tool_parser(name)
    rng = random.Random(0)
    for text, content, calls in cases:
        got_content, got_calls = parse(text, TOOLS)
        assert (got_content, calls_of(got_calls)) == (content, calls), text
        for _ in range(20):  # any split of the stream joins to the same message
            s_content, s_calls = streamed(name, text, rng)
            assert (s_content, calls_of(s_calls)) == (content, calls), text


def test_qwen3_stream_sends_content_before_the_call_and_each_call_when_complete():
    s = ToolCallStream("qwen3", TOOLS)
    assert s.feed("Let me check.") == ("Let me check.", [])
    assert s.feed("\n<tool") == ("", [])  # may start a call: held
    assert s.feed('_call>\n{"name":"get_weather",') == ("", [])
    content, calls = s.feed('"arguments":{"location":"SF"}}\n</tool_call>')
    assert content == "" and calls_of(calls) == [("get_weather", {"location": "SF"})]
    assert s.finish() == ("", [])


REASONING_CASES = [
    # deepseek-r1: the template opened <think>; everything before </think> is reasoning
    ("deepseek-r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("deepseek-r1", "<think>R</think>C", "<think>R", "C"),  # upstream's parse keeps a generated start tag
    ("deepseek-r1", "still thinking", "still thinking", ""),
    # qwen3: reasoning only inside <think>...</think>
    ("qwen3", "<think>\nplan\n</think>\n\nHello!", "\nplan\n", "\n\nHello!"),
    ("qwen3", "Hello, no reasoning.", "", "Hello, no reasoning."),
]


@pytest.mark.parametrize("name, text, reasoning, content", REASONING_CASES)
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content):
    whole = reasoning_parser(name).parse(text)
    assert (whole.reasoning_content, whole.content) == (reasoning, content)
    rng = random.Random(1)
    for _ in range(30):
        p, r, c = reasoning_parser(name), "", ""
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10))))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            out = p.parse_delta(text[a:b])
            r, c = r + out.reasoning_content, c + out.content
        out = p.finish()
        assert (r + out.reasoning_content, c + out.content) == (reasoning, content), cuts
