"""The twin's tool and reasoning parsers on upstream-format texts, against the output upstream's own tests expect.

Qwen3, Qwen3-Coder, Kimi-K2 and DeepSeek-V3 / V3.1 / V3.2 cases are TensorRT-LLM's (``TestQwen3ToolParser``,
``TestQwen3CoderToolParser``, ``TestKimiK2ToolParser``, ``TestDeepSeekV3Parser``, ``TestDeepSeekV31Parser``,
``TestDeepSeekV32Parser`` in
``tests/unittest/llmapi/apps/test_tool_parsers.py``, NVIDIA/TensorRT-LLM, the revision whose imports are the six
parsers of ``tool_parser_factory.py@34eff6ae``; the code index did not give its commit). Where that revision expects
a call to an undefined function dropped and the ported ``parse_base_json`` (``base_tool_parser.py@01bf1923``) keeps
it, the case says so. The harmony case is Dynamo's fixture (``lib/parsers/src/tool_calling/test_cases/fixtures/
harmony.rs@9c29c8ec``); the Llama 3 case is Dynamo's ``llama3_json`` fixture shape
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


CODER_CASES = [
    (  # detect_and_parse_single_tool: content is everything outside the blocks, unstripped
        "Normal text\n<tool_call>\n<function=get_weather>\n<parameter=location>NYC</parameter>\n</function>\n"
        "</tool_call>",
        "Normal text\n",
        [("get_weather", {"location": "NYC"})],
    ),
    (  # detect_and_parse_multiple_tools
        "<tool_call>\n<function=get_weather>\n<parameter=location>LA</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=search_web>\n<parameter=query>AI</parameter>\n</function>\n</tool_call>",
        "\n",
        [("get_weather", {"location": "LA"}), ("search_web", {"query": "AI"})],
    ),
    (  # detect_and_parse_malformed_tool (a typo in the start tag): no call, all content
        "<too_call>\n<function=get_weather>\n<parameter=location>San Francisco, CA</parameter>\n</function>\n"
        "</tool_call>",
        "<too_call>\n<function=get_weather>\n<parameter=location>San Francisco, CA</parameter>\n</function>\n"
        "</tool_call>",
        [],
    ),
    (  # test_qwen3_coder_format_compliance: the newlines around a value are dropped
        "<tool_call>\n<function=execute_bash>\n<parameter=command>\npwd && ls\n</parameter>\n</function>\n</tool_call>",
        "",
        [("execute_bash", {"command": "pwd && ls"})],
    ),
    (  # values are JSON, then Python literals, then strings (_safe_val)
        "<tool_call>\n<function=search_web>\n<parameter=query>[1, 2]</parameter>\n<parameter=n>{'a': 3}</parameter>"
        "\n<parameter=s>two words</parameter>\n</function>\n</tool_call>",
        "",
        [("search_web", {"query": [1, 2], "n": {"a": 3}, "s": "two words"})],
    ),
    (  # undefined_tool: that test revision drops it; parse_base_json@01bf1923 keeps it
        "<tool_call>\n<function=undefined_func>\n<parameter=arg>value</parameter>\n</function>\n</tool_call>",
        "",
        [("undefined_func", {"arg": "value"})],
    ),
    ("unterminated <tool_call>\n<function=get_weather>", "unterminated <tool_call>\n<function=get_weather>", []),
]

KIMI = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
SB, SE, CB, AB, CE = KIMI
KIMI_CASES = [
    (  # detect_and_parse_single_tool
        f'Normal text{SB}{CB}functions.get_weather:0{AB}{{"location": "NYC"}}{CE}{SE}',
        "Normal text",
        [("get_weather", {"location": "NYC"})],
    ),
    (  # detect_and_parse_multiple_tools
        f'{SB}{CB}functions.get_weather:0{AB}{{"location":"LA"}}{CE}\n'
        f'{CB}functions.search_web:0{AB}{{"query":"AI"}}{CE}{SE}',
        "",
        [("get_weather", {"location": "LA"}), ("search_web", {"query": "AI"})],
    ),
    (f"{SB}{CB}functions.get_weather:0{AB}MALFORMED{CE}{SE}", "", []),  # detect_and_parse_malformed_tool
    (  # undefined_tool: dropped (KimiK2ToolParser checks the tools itself)
        f'{SB}{CB}functions.undefined_func:0{AB}{{"arg":"any value"}}{CE}{SE}',
        "",
        [],
    ),
    (  # nested arguments: the non-greedy object still reaches the end marker
        f'Let me look.{SB}{CB}functions.search_web:1{AB}{{"query": {{"q": "x"}}}}{CE}{SE}',
        "Let me look.",
        [("search_web", {"query": {"q": "x"}})],
    ),
    ("This is just a regular response.", "This is just a regular response.", []),
]

D_SB, D_SE, D_CB, D_CE, D_SEP = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def dsv3_call(name: str, args: str) -> str:
    return f"{D_CB}function{D_SEP}{name}\n```json\n{args}\n```{D_CE}"


DSV3_CASES = [
    (  # detect_and_parse_single_tool: the text is stripped
        f"Lead {D_SB}{dsv3_call('get_weather', json.dumps({'location': 'Tokyo'}))}{D_SE}",
        "Lead",
        [("get_weather", {"location": "Tokyo"})],
    ),
    (  # detect_and_parse_multiple_tools
        f"{D_SB}{dsv3_call('get_weather', json.dumps({'location': 'Paris'}))}"
        f"{D_SB}{dsv3_call('search_web', json.dumps({'query': 'AI'}))}{D_SE}",
        "",
        [("get_weather", {"location": "Paris"}), ("search_web", {"query": "AI"})],
    ),
    (  # detect_and_parse_malformed_tool: nothing parses, the whole text is content
        f"{D_SB}{dsv3_call('get_weather', repr({'location': 'Paris'}))}{D_SE}",
        f"{D_SB}{dsv3_call('get_weather', repr({'location': 'Paris'}))}{D_SE}",
        [],
    ),
    (  # detect_and_parse_with_parameters_key: the arguments object is taken as it is
        f"{D_SB}{dsv3_call('search_web', json.dumps({'parameters': {'query': 'TensorRT'}}))}{D_SE}",
        "",
        [("search_web", {"parameters": {"query": "TensorRT"}})],
    ),
    (  # undefined_tool: that test revision drops it; parse_base_json@01bf1923 keeps it
        f"{D_SB}{dsv3_call('unknown', json.dumps({'x': 1}))}{D_SE}",
        "",
        [("unknown", {"x": 1})],
    ),
]


def dsv31_call(name: str, args: str) -> str:
    return f"{D_CB}{name}{D_SEP}{args}{D_CE}"


DSV31_CASES = [
    (  # detect_and_parse_single_tool: the text is stripped
        f"Intro {D_SB}{dsv31_call('get_weather', json.dumps({'location': 'Tokyo'}))}{D_SE}",
        "Intro",
        [("get_weather", {"location": "Tokyo"})],
    ),
    (  # detect_and_parse_multiple_tools
        f"{D_SB}{dsv31_call('get_weather', json.dumps({'location': 'Paris'}))}"
        f"{D_SB}{dsv31_call('search_web', json.dumps({'query': 'AI'}))}{D_SE}",
        "",
        [("get_weather", {"location": "Paris"}), ("search_web", {"query": "AI"})],
    ),
    (  # detect_and_parse_malformed_tool: the whole text is content
        f"{D_SB}{D_CB}get_weather{D_SEP}{{'location':'Paris'}}{D_CE}{D_SE}",
        f"{D_SB}{D_CB}get_weather{D_SEP}{{'location':'Paris'}}{D_CE}{D_SE}",
        [],
    ),
    (  # detect_and_parse_with_parameters_key
        f"{D_SB}{dsv31_call('search_web', json.dumps({'parameters': {'query': 'TensorRT'}}))}{D_SE}",
        "",
        [("search_web", {"parameters": {"query": "TensorRT"}})],
    ),
]

DSML = "｜DSML｜"
DSV32_CASES = [
    (  # detect_and_parse_single_tool
        f'Normal text<{DSML}function_calls> <{DSML}invoke name="get_weather"> <{DSML}parameter name="location" '
        f'string="true">NYC</{DSML}parameter> </{DSML}invoke> </{DSML}function_calls>',
        "Normal text",
        [("get_weather", {"location": "NYC"})],
    ),
    (  # detect_and_parse_multiple_tools: parameter tags, then a JSON body
        f'<{DSML}function_calls> <{DSML}invoke name="get_weather"> <{DSML}parameter name="location" string="true">'
        f'NYC</{DSML}parameter> </{DSML}invoke> <{DSML}invoke name="search_web"> {{ "query": "AI" }} </{DSML}invoke>'
        f" </{DSML}function_calls>",
        "",
        [("get_weather", {"location": "NYC"}), ("search_web", {"query": "AI"})],
    ),
    (  # detect_and_parse_malformed_tool: "|" for "｜", no call
        '<|DSML|function_calls> <|DSML|invoke name="get_weather"> <|DSML|parameter name="location" string="true">'
        "NYC</|DSML|parameter> </|DSML|invoke> </|DSML|function_calls>",
        '<|DSML|function_calls> <|DSML|invoke name="get_weather"> <|DSML|parameter name="location" string="true">'
        "NYC</|DSML|parameter> </|DSML|invoke> </|DSML|function_calls>",
        [],
    ),
    (  # a non-string parameter is JSON
        f'<{DSML}function_calls><{DSML}invoke name="search_web"><{DSML}parameter name="n" string="false">[1, 2]'
        f"</{DSML}parameter></{DSML}invoke></{DSML}function_calls>",
        "",
        [("search_web", {"n": [1, 2]})],
    ),
]

HARMONY_CASES = [
    (  # Dynamo's case_1_single_call
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"SF"}<|call|>',
        "",
        [("get_weather", {"location": "SF"})],
    ),
    (  # content around the calls stays; a function the request lacks is dropped (trtllm-serve's filter)
        'Checking.<|channel|>commentary to=functions.search_web <|constrain|>json<|message|>{"query":"AI"}<|call|>'
        "<|channel|>commentary to=functions.nope <|constrain|>json<|message|>{}<|call|>",
        "Checking.",
        [("search_web", {"query": "AI"})],
    ),
    ("The weather is fine.", "The weather is fine.", []),
]


@pytest.mark.parametrize(
    "name, cases",
    [
        ("qwen3_coder", CODER_CASES),
        ("kimi_k2", KIMI_CASES),
        ("deepseekv3", DSV3_CASES),
        ("deepseekv3.1", DSV31_CASES),
        ("deepseek_v32", DSV32_CASES),
        ("harmony", HARMONY_CASES),
    ],
)
def test_ported_tool_parsers_whole_and_streamed(name, cases):
    test_tool_parsers_give_upstreams_expected_output(name, cases)


def test_a_call_is_streamed_once_its_end_marker_arrives():
    s = ToolCallStream("kimi_k2", TOOLS)
    assert s.feed("Sure.<|tool_calls_sec") == ("Sure.", [])  # a marker may be starting: held
    assert s.feed(f'tion_begin|>{CB}functions.get_weather:0{AB}{{"location":') == ("", [])
    content, calls = s.feed(f'"SF"}}{CE}')
    assert content == "" and calls_of(calls) == [("get_weather", {"location": "SF"})]
    assert s.finish() == ("", [])
    d = ToolCallStream("deepseekv3", TOOLS)  # a later bad call makes it all content: calls wait for the end
    d.feed(f"{D_SB}{dsv3_call('get_weather', '{}')}")
    assert d.calls == []
    assert calls_of(d.finish()[1]) == [("get_weather", {})]


BRAZIL_R = (
    "The user asks a simple factual question: capital of Brazil. The answer is Brasília. No additional explanation "
    "needed."
)
HEALTH_R = (
    'User asks: "Hey, quick check: is everything up and running?" We should check system health using the provided '
    "function get_system_health. Use function."
)
HEALTH_CALL = "<|channel|>commentary to=functions.get_system_health <|constrain|>json<|message|>{}"
GPT_OSS_CASES = [  # Dynamo's GptOssReasoningParser tests (gpt_oss_parser.rs@0f70f478)
    (
        f"<|channel|>analysis<|message|>{BRAZIL_R}<|end|><|start|>assistant<|channel|>final<|message|>"
        "The capital of Brazil is Brasília.",
        BRAZIL_R,
        "The capital of Brazil is Brasília.",
    ),
    ("<|channel|>final<|message|>answer", "", "answer"),
    (
        "<|channel|>analysis<|message|>first<|end|><|start|>assistant<|channel|>analysis<|message|>second<|end|>"
        "<|start|>assistant<|channel|>final<|message|>done",
        "first\nsecond",
        "done",
    ),
    ("<|channel|>analysis<|message|>thinking<|e", "thinking<|e", ""),  # the held-back suffix is flushed at the end
    (  # a call is handed on whole, with its arguments (Dynamo's stream drops the "{}": its TODO)
        f"<|channel|>analysis<|message|>{HEALTH_R}<|end|><|start|>assistant{HEALTH_CALL}",
        HEALTH_R,
        HEALTH_CALL + "<|call|>",
    ),
    ("no harmony here", "", "no harmony here"),
]


@pytest.mark.parametrize("text, reasoning, content", GPT_OSS_CASES)
def test_gpt_oss_reasoning_whole_and_streamed(text, reasoning, content):
    test_reasoning_split_whole_and_streamed("gpt_oss", text, reasoning, content)


def test_gpt_oss_then_harmony_tool_parser_gives_the_call():
    text = f"<|channel|>analysis<|message|>{HEALTH_R}<|end|><|start|>assistant{HEALTH_CALL}<|call|>"
    split = reasoning_parser("gpt_oss").parse(text)
    content, calls = tool_parser("harmony")(split.content, {"get_system_health"})
    assert (split.reasoning_content, content, calls_of(calls)) == (HEALTH_R, "", [("get_system_health", {})])


def test_harmony_recipient_before_the_channel_is_the_same_call():
    """Harmony lets the recipient come first in a header (``<|start|>assistant to=functions.NAME<|channel|>
    commentary json<|message|>``), as xgrammar's harmony tag also allows: the same call."""
    text = (
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"a":1}<|call|>'
    )
    split = reasoning_parser("gpt_oss").parse(text)
    content, calls = tool_parser("harmony")(split.content, TOOLS)
    assert (split.reasoning_content, content, calls_of(calls)) == ("", "", [("get_weather", {"a": 1})])


LONG_CASES = [
    ("qwen3", QWEN3_CASES),
    ("llama3_json", LLAMA3_CASES),
    ("qwen3_coder", CODER_CASES),
    ("kimi_k2", KIMI_CASES),
    ("deepseekv3", DSV3_CASES),
    ("deepseekv3.1", DSV31_CASES),
    ("deepseek_v32", DSV32_CASES),
    ("harmony", HARMONY_CASES),
]


@pytest.mark.parametrize("name, cases", LONG_CASES)
def test_long_answers_stream_as_their_whole_parse(name, cases):
    """A long answer (each case's text 40 times over, then all of them in turn) fed in 1-7 character pieces joins
    to the whole parse, and a format with a call end marker sends its calls before the end: the stream reads each
    piece once (ToolCallStream.feed parses from the previous call's end), which must not change what it gives."""
    rng = random.Random(f"long-{name}")
    texts = [text * 40 for text, _, _ in cases] + ["".join(text for text, _, _ in cases) * 10]
    for text in texts:
        cuts, i = [], 0
        while i < len(text):
            i += rng.randint(1, 7)
            cuts.append(min(i, len(text)))
        s, content, calls = ToolCallStream(name, TOOLS), "", []
        for a, b in zip([0, *cuts], cuts):
            c, new = s.feed(text[a:b])
            content, calls = content + c, calls + new
        before_end = len(calls)
        c, new = s.finish()
        assert (content + c, calls + new) == tool_parser(name)(text, TOOLS)
        if s.format.call_end and s.format.segment is not None:
            assert before_end == len(calls + new)  # every call was sent once its end marker arrived


def test_long_gpt_oss_answers_stream_as_their_whole_split():
    """Long harmony answers (each case 40 times over, then all in turn, then one long analysis) fed in 1-7
    character pieces join to the whole split: HarmonyReasoning reads each piece once, which must not change it."""
    rng = random.Random("long-gpt-oss")
    texts = [text * 40 for text, _, _ in GPT_OSS_CASES] + ["".join(text for text, _, _ in GPT_OSS_CASES) * 10]
    texts.append("<|channel|>analysis<|message|>" + "a <b> <|c " * 500 + "<|end|><|start|>assistant<|channel|>final")
    for text in texts:
        p, reasoning, content, i = reasoning_parser("gpt_oss"), "", "", 0
        while i < len(text):
            n = rng.randint(1, 7)
            out = p.parse_delta(text[i : i + n])
            reasoning, content, i = reasoning + out.reasoning_content, content + out.content, i + n
        out = p.finish()
        whole = reasoning_parser("gpt_oss").parse(text)
        assert (reasoning + out.reasoning_content, content + out.content) == (whole.reasoning_content, whole.content)
