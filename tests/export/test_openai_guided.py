"""Structured output through the OpenAI twin over real HTTP: ``response_format`` json_schema (OpenAI's wrapper, with
``strict``), json, json_object, regex, ebnf and structural_tag; trtllm-serve's errors for malformed formats; the
``openai`` SDK's own structured-output path (``client.chat.completions.parse`` with a pydantic model) unchanged;
sampled outputs 100 % valid against their schema; the guided counters in /prometheus/metrics.

The model is a random Llama with stories260k's real tokenizer (tests/serving/test_guided.py says why: the trained
260k model prefers whitespace forever inside JSON, which the grammar allows)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

from guided_oracle import SCHEMAS  # noqa: E402

NAME = "guided-twin"
TEMPLATE = (Path(__file__).parent / "data" / "chat_template.jinja").read_text()
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory, stories_dir):
    from trtpipe.models.synthetic import make_synthetic

    d = make_synthetic("llama", tmp_path_factory.mktemp("guided_openai") / "hf", seed=1, vocab_size=512, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories_dir / f, d / f)
    return d


@pytest.fixture(scope="module")
def server(synthetic_dir):
    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    config = dataclasses.replace(twin_default(256), guided_decoding_backend="xgrammar")
    served = ServedModel(synthetic_dir, NAME, config, chat_template=TEMPLATE)
    with serve_in_thread(OpenAIServer(served).app) as url:
        yield url, served


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def _doc(text: str):
    """RFC 8259 JSON, else with raw control characters in strings allowed (xgrammar 0.2.9's schema grammars admit
    them: mlc-ai/xgrammar#286)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text, strict=False)


def test_sampled_json_schema_outputs_are_valid(client):
    """Every schema, 4 seeds each, chat and completions: each output that ends (finish_reason stop) validates."""
    valid = 0
    for schema in SCHEMAS.values():
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        for seed in range(4):
            r = client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": "Tell me about Lily."}],
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                response_format=fmt,
            )
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(_doc(r.choices[0].message.content), schema)
            valid += 1
        r = client.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=7,
            extra_body={"response_format": {"type": "json", "schema": schema}},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(_doc(r.choices[0].text), schema)
        valid += 1
    assert valid == 5 * len(SCHEMAS)


def test_streamed_output_is_the_same_document(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["nested"]}}
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=200, temperature=1.0, seed=3)
    whole = client.chat.completions.create(response_format=fmt, **kw).choices[0].message.content
    parts = [
        c.choices[0].delta.content or "" for c in client.chat.completions.create(response_format=fmt, stream=True, **kw)
    ]
    assert "".join(parts) == whole
    jsonschema.validate(_doc(whole), SCHEMAS["nested"])


@pytest.mark.parametrize(
    "fmt, check",
    [
        ({"type": "json_object"}, lambda s: isinstance(_doc(s), (dict, list))),
        ({"type": "regex", "regex": "[a-z]{3}-[0-9]{2}"}, lambda s: re.fullmatch("[a-z]{3}-[0-9]{2}", s)),
        ({"type": "ebnf", "ebnf": 'root ::= ("yes" | "no") "."'}, lambda s: s in ("yes.", "no.")),
        (
            {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": "<n>",
                    "content": {"type": "regex", "pattern": "[0-9]{1,3}"},
                    "end": "</n>",
                },
            },
            lambda s: re.fullmatch("<n>[0-9]{1,3}</n>", s),
        ),
    ],
    ids=["json_object", "regex", "ebnf", "structural_tag"],
)
def test_other_response_formats(client, fmt, check):
    ended = 0
    for seed in range(4):  # json_object's strings are unbounded: one may run to max_tokens (then it is not checked)
        r = client.completions.create(
            model=NAME, prompt="Once", max_tokens=120, temperature=1.0, seed=seed, extra_body={"response_format": fmt}
        )
        if r.choices[0].finish_reason == "stop":
            ended += 1
            assert check(r.choices[0].text), r.choices[0].text
    assert ended >= 1


def test_openai_sdk_parse_with_a_pydantic_model(client):
    """The SDK's own structured-output path, unchanged: it sends json_schema with strict and parses the reply."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["dog", "cat", "bird"]
        legs: int = Field(ge=0, le=8)
        friendly: bool

    class Story(BaseModel):
        pets: list[Pet] = Field(min_length=1, max_length=2)
        mood: Literal["happy", "sad"]

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in range(3):
        r = parse(model=NAME, messages=[{"role": "user", "content": "A story"}], response_format=Story,
                  max_tokens=250, temperature=1.0, seed=seed)  # fmt: skip
        story = r.choices[0].message.parsed
        assert isinstance(story, Story) and 1 <= len(story.pets) <= 2, r.choices[0].message.content


def test_malformed_formats_answer_400_as_trtllm_serve(client):
    import openai

    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ({"type": "json"}, "response_format.schema is required for response_format.type == 'json', but got None."),
        ({"type": "json_schema"}, "response_format.json_schema is required"),
        ({"type": "regex"}, "response_format.regex is required"),
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "text", "bogus": 1}, "bogus: extra inputs are not permitted"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 3}}},
            "invalid json_schema",
        ),
        ({"type": "regex", "regex": "([a-z"}, "invalid regex guide"),
    ]
    for fmt, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, response_format=fmt)
        assert message in str(err.value), (fmt, str(err.value))
    ok = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=4, response_format={"type": "text"})
    assert ok.choices[0].message.content is not None  # text is no guide, as before


def test_guided_counters_in_prometheus(server, client):
    import urllib.request

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}
    for _ in range(2):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=40,
                                       response_format=fmt)  # fmt: skip
    text = urllib.request.urlopen(server[0] + "/prometheus/metrics", timeout=60).read().decode()
    values = {m[0]: float(m[1]) for m in re.findall(r"^(trtpipe_guided_\w+)\{[^}]*\} (\S+)$", text, re.M)}
    assert values["trtpipe_guided_requests_total"] >= 2
    assert values["trtpipe_guided_grammar_cache_hits_total"] >= 1  # the second request reused the first's grammar
    assert values["trtpipe_guided_grammar_compile_seconds_total"] > 0
    assert values["trtpipe_guided_grammar_compiles_total"] >= 1


def test_guided_decoding_off_refuses_a_guide(synthetic_dir):
    """A server started without guided_decoding_backend answers a response_format with 400, not free text."""
    import openai
    from openai import OpenAI

    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    served = ServedModel(synthetic_dir, NAME, twin_default(256), chat_template=TEMPLATE)
    with serve_in_thread(OpenAIServer(served).app) as url:
        c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="Guided decoding is not enabled"):
            c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                      response_format={"type": "json_object"})  # fmt: skip
    served.shutdown()


def test_llguidance_backend_answers_valid_json_schema_outputs(synthetic_dir):
    """A server started with guided_decoding_backend: llguidance: every schema, 4 seeds, each answer that ends
    (finish_reason stop; llguidance, like xgrammar, lets whitespace run on, so a random model may reach max_tokens)
    a valid strict RFC 8259 document; a structural tag is refused with 400 (llguidance takes none, as upstream)."""
    import openai
    from openai import OpenAI

    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    pytest.importorskip("llguidance")
    config = dataclasses.replace(twin_default(256), guided_decoding_backend="llguidance")
    served = ServedModel(synthetic_dir, NAME, config, chat_template=TEMPLATE)
    with serve_in_thread(OpenAIServer(served).app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        ended = 0
        for schema in SCHEMAS.values():
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
            for seed in range(4):
                r = client.chat.completions.create(
                    model=NAME,
                    messages=[{"role": "user", "content": "Tell me about Lily."}],
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    response_format=fmt,
                )
                if r.choices[0].finish_reason == "stop":
                    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
                    ended += 1
        assert ended >= 2 * len(SCHEMAS), ended
        tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
        with pytest.raises(openai.BadRequestError, match="structural_tag"):
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, response_format=tag
            )
