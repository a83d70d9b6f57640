"""Guided decoding through a real tritonserver: ``guided_decoding_guide_type`` / ``guided_decoding_guide`` sent to
the ensemble and to the BLS (tensorrtllm_backend docs/guided_decoding.md@395c4035) reach the twin's executor, which
reads the tokenizer information the repository wrote (xgrammar_tokenizer_info.json). Sampled JSON-schema outputs
are 100 % valid; regex and EBNF outputs match; a bad guide fails its own request and the server goes on.

The engine is a random Llama with stories260k's real tokenizer (tests/serving/test_guided.py says why)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.errors import ServingError  # noqa: E402
from trtpipe.triton.client import Client, GenerateOptions  # noqa: E402
from trtpipe.triton.repo import write_repo  # noqa: E402
from trtpipe.triton.server_process import start_server  # noqa: E402

from triton_helpers import BUILD_CONFIG  # noqa: E402

from guided_oracle import SCHEMAS  # noqa: E402

pytestmark = [pytest.mark.triton, pytest.mark.slow]
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def server(stories_dir, stories_recipe, tmp_path_factory):
    from trtpipe.checkpoint.convert import convert
    from trtpipe.engine.twin_engine_dir import write_twin_engine
    from trtpipe.models.synthetic import make_synthetic

    root = tmp_path_factory.mktemp("guided_triton")
    hf = make_synthetic("llama", root / "hf", seed=1, vocab_size=512, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories_dir / f, hf / f)
    engine = write_twin_engine(convert(hf, root / "ckpt", tp=1, dtype="float32"), root / "engine", dict(BUILD_CONFIG))
    recipe = stories_recipe("serving.guided_decoding_backend=xgrammar", "triton.bls=true")
    write_repo(recipe, engine, engine / "checkpoint", root / "repo")
    with start_server(root / "repo", timeout=240) as s:
        yield s


def _doc(text: str):
    """RFC 8259 JSON, else with raw control characters in strings (xgrammar 0.2.9 admits them: mlc-ai/xgrammar#286)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text, strict=False)


def _opts(kind: str, guide, seed: int, max_tokens: int = 200) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=seed,
        exclude_input_in_output=True,
        guided_decoding_guide_type=kind,
        guided_decoding_guide=guide,
    )


@pytest.mark.parametrize("front", ["ensemble", "tensorrt_llm_bls"])
def test_sampled_json_schema_outputs_are_valid(server, front):
    with Client(server.grpc_url, model=front) as c:
        for schema in SCHEMAS.values():
            for seed in range(3):
                text = c.generate("Once upon a time", _opts("json_schema", json.dumps(schema), seed))
                jsonschema.validate(_doc(text), schema)


def test_regex_ebnf_and_json_guides(server):
    with Client(server.grpc_url, model="ensemble") as c:
        for seed in range(3):
            text = c.generate("Once", _opts("regex", "[a-z]{3}-[0-9]{2}", seed))
            assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text
            text = c.generate("Once", _opts("ebnf_grammar", 'root ::= ("yes" | "no") "."', seed))
            assert text in ("yes.", "no."), text
        text = c.generate("Once", _opts("json", None, 0, max_tokens=40))  # builtin JSON grammar: starts a document
        assert text.lstrip()[:1] in ("{", "["), text


def test_a_bad_guide_fails_its_own_request(server):
    with Client(server.grpc_url, model="ensemble") as c:
        with pytest.raises(ServingError, match="'xml' is not one of json, json_schema"):
            c.generate("Once", _opts("xml", "<a/>", 0))
        with pytest.raises(ServingError, match="invalid json_schema guide"):
            c.generate("Once", _opts("json_schema", '{"type": "object", "properties": 3}', 0))
        text = c.generate("Once", _opts("regex", "[0-9]{4}", 1))  # the server goes on
        assert re.fullmatch("[0-9]{4}", text), text


def _guided_counters(server) -> dict[str, float]:
    """The tensorrt_llm model's trtpipe_guided_* counters on the metrics port."""
    import urllib.request

    url = f"http://{server.bind}:{server.ports.metrics}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.findall(r'^(trtpipe_guided_\w+)\{[^}]*model="tensorrt_llm"[^}]*\} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def test_the_triton_twin_exports_the_guided_counters(server):
    """The OpenAI twin's trtpipe_guided_* counters (trtpipe.serving.guided.COUNTERS) as Triton metric families of
    tensorrt_llm: a new guide compiles once, its second use is a cache hit, both are constrained requests, a guide
    that does not compile is counted as invalid. The families refresh every stats_check_period_ms: polled."""
    import time

    from trtpipe.serving.guided import COUNTERS

    before = _guided_counters(server)
    assert sorted(before) == sorted(name for name, _, _ in COUNTERS)
    with Client(server.grpc_url, model="ensemble") as c:
        for seed in (0, 1):  # a regex no other test sends
            assert re.fullmatch("[a-z]{2}=[0-9]{3}", c.generate("Once", _opts("regex", "[a-z]{2}=[0-9]{3}", seed)))
        with pytest.raises(ServingError, match="invalid json_schema guide"):
            c.generate("Once", _opts("json_schema", '{"type": "object", "properties": 4}', 0))
    want = {
        "trtpipe_guided_requests_total": 2,
        "trtpipe_guided_grammar_compiles_total": 1,
        "trtpipe_guided_grammar_cache_hits_total": 1,
        "trtpipe_guided_invalid_guides_total": 1,
    }
    deadline = time.monotonic() + 30  # a wait for the next report, not a timing assertion
    while True:
        now = _guided_counters(server)
        grown = {name: now[name] - before[name] for name in want}
        if grown == want or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grown == want
    assert now["trtpipe_guided_grammar_compile_seconds_total"] > before["trtpipe_guided_grammar_compile_seconds_total"]
