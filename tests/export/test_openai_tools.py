"""Tool calls and reasoning through the OpenAI twin, with the official ``openai`` SDK over real HTTP.

The model is a random Qwen3 with a real tokenizer and Qwen3's chat template (tests/qwen3_chat.py), served with the
``qwen3`` tool and reasoning parsers. What must hold whatever a random model says: the tools reach the chat template
(the prompt's token count is the template's with ``tools=``); the answer is the server's raw text split by the
parsers (the raw text read back through ``/v1/completions`` on the same token ids); the SDK's reassembly of the
streamed deltas equals the non-streamed message; bad tool requests are one-line 400s naming the field.
"""

from __future__ import annotations

import json
import re

import pytest
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

NAME = "qwen3-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -999, "maximum": 999},
                    "b": {"type": "integer", "minimum": -999, "maximum": 999},
                },
                "required": ["a", "b"],
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qwen3_chat import make_qwen3_chat

    return make_qwen3_chat(tmp_path_factory.mktemp("qwen3chat") / "m")


@pytest.fixture(scope="module")
def served(model_dir):
    from trtpipe.serving.config import replace_knobs, twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    config = replace_knobs(twin_default(1024), guided_decoding_backend="xgrammar")
    s = ServedModel(model_dir, NAME, config, tool_parser="qwen3", reasoning_parser="qwen3")
    with serve_in_thread(OpenAIServer(s).app) as url:
        yield url, s


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def raw_text(client, served, tools, seed, n):
    """The server's own text for the chat prompt (completions on the template's token ids, same sampling)."""
    tok = served[1].tokenizer
    text = tok.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    out = client.completions.create(model=NAME, prompt=ids, max_tokens=n, temperature=1.0, seed=seed)
    return ids, out.choices[0].text


def reassembled(client, kw):
    """The SDK's own reassembly of a stream's chunks (its ChatCompletionStreamState; the stream helper itself
    refuses answers cut at max_tokens)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(**kw, stream=True):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def message_fields(msg) -> tuple:
    extra = msg.model_extra or {}
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    return msg.content or None, extra.get("reasoning_content"), calls  # a stream's first chunk says content ""


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_answer_is_the_raw_text_parsed_and_the_stream_reassembles_to_it(client, served, seed):
    from trtpipe.serving.chat_output import ChatOutput, tool_request

    ids, raw = raw_text(client, served, TOOLS, seed, 40)
    kw = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=40, temperature=1.0, seed=seed)
    whole = client.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens == len(ids)  # the template rendered the tools
    expected = ChatOutput("qwen3", "qwen3", tool_request({"tools": TOOLS}, "qwen3")).message(raw)
    got = whole.choices[0].message
    assert got.content == expected["content"]
    assert (got.model_extra or {}).get("reasoning_content") == expected.get("reasoning_content")
    final = reassembled(client, kw)
    assert message_fields(final.choices[0].message) == message_fields(got)
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("seed", range(3))
def test_reasoning_content_split_streamed_and_not(client, seed):
    """An answer made to think first (a regex guide: ``<think>...</think>`` then text), split by the qwen3 reasoning
    parser: reasoning_content is what the tags enclose, content what follows; the SDK's reassembly of the stream's
    reasoning_content / content deltas gives the same two fields."""
    regex = "<think>[a-z ]{1,24}</think>[a-z ]{1,24}"
    kw = dict(model=NAME, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=seed)
    kw["response_format"] = {"type": "regex", "regex": regex}
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and msg.content, msg
    assert re.fullmatch("[a-z ]{1,24}", reasoning) and re.fullmatch("[a-z ]{1,24}", msg.content), msg
    final = reassembled(client, kw)
    assert message_fields(final.choices[0].message) == message_fields(msg)


@pytest.mark.parametrize(
    "extra, param, pattern",
    [
        ({"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools", "name must be"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ],
)
def test_bad_tool_requests_are_400(client, extra, param, pattern):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, **extra)
    body = err.value.body
    assert body["param"] == param and pattern in body["message"], json.dumps(body)


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "choice, parallel", [("required", True), ("required", False), ("get_weather", None), ("add", None)]
)
def test_required_and_named_choices_always_parse(client, choice, parallel, seed):
    """A random model's calls, constrained by the tool-call grammar: each parses, names an allowed tool and has
    arguments valid against its schema; the SDK's reassembly of the stream equals the non-streamed message.
    With parallel calls allowed, free text may follow the calls (xgrammar's triggered tags) until max_tokens."""
    import jsonschema

    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    kw = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    kw.update(temperature=1.0, seed=seed)
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    whole = client.chat.completions.create(**kw)
    c = whole.choices[0]
    assert c.finish_reason in (("length", "tool_calls") if parallel else ("tool_calls",)), c
    calls = c.message.tool_calls
    assert calls and (parallel or len(calls) == 1), c
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert choice == "required" or call.function.name == choice
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    final = reassembled(client, kw)
    assert message_fields(final.choices[0].message) == message_fields(c.message)
    assert final.choices[0].finish_reason == c.finish_reason


def test_constrained_choices_need_a_guided_backend(model_dir):
    import openai
    from openai import OpenAI

    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    plain = ServedModel(model_dir, NAME, tool_parser="qwen3")
    with serve_in_thread(OpenAIServer(plain).app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="guided_decoding_backend"):
            client.chat.completions.create(
                model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=4
            )
