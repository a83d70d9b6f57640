"""Guided decoding in the executor: the token mask in the sampling step, the matcher ending the request, a bad
guide failing its own request, the compile cache; greedy output equal to transformers + xgrammar's HF logits
processor, and sampled output valid against its schema."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from trtpipe.serving.api import ErrorKind, ExecutorConfig, FinishReason, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.guided import (
    Guide,
    GuidedDecoder,
    GuidedDecodingParams,
    GuideError,
    GuideType,
    upstream_tokenizer_info,
)
from trtpipe.serving.reference_engine import ReferenceEngine

from guided_oracle import SCHEMAS, check_guided_greedy, hf_compiled
from serving_oracle import check_greedy

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

EOS, VOCAB = 2, 512
PROMPT_TEXT = "Once upon a time, Lily wrote: "


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module")
def decoder(tokenizer):
    return GuidedDecoder.from_tokenizer("xgrammar", tokenizer, VOCAB)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory, stories_dir):
    """(float32 reference model, float64 transformers) of a random Llama with stories260k's real tokenizer: its
    near-uniform logits walk through every value a schema allows (the trained model prefers whitespace)."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import load_hf, make_synthetic
    from trtpipe.runtime import load_checkpoint

    d = make_synthetic("llama", tmp_path_factory.mktemp("guided") / "hf", seed=1, vocab_size=VOCAB, eos_token_id=EOS)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories_dir / f, d / f)
    model = load_checkpoint(convert(d, d.parent / "tp1", tp=1, pp=1, dtype="float32"))
    return model, load_hf(d).double()


def _config(**kw) -> ExecutorConfig:
    base = dict(
        max_batch_size=8, max_num_tokens=256, max_input_len=96, max_seq_len=256, num_blocks=64, tokens_per_block=8
    )
    return ExecutorConfig(**{**base, **kw})


def _serve(model, decoder, requests: list[Request]):
    """All requests submitted at once (one in-flight batch); the final response of each, in order."""
    final = {}
    core = ExecutorCore(
        _config(),
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        guided=decoder,
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids]


def _schema_guide(schema: dict) -> Guide:
    return Guide(GuideType.JSON_SCHEMA, json.dumps(schema))


# ---- the guide's forms ---------------------------------------------------------------------------------------


def test_llm_api_params_map_to_executor_guides():
    """SamplingParams._get_guided_decoding_params (tensorrt_llm/sampling_params.py@000a01de)."""
    assert GuidedDecodingParams(json_object=True).guide() == Guide(GuideType.JSON)
    assert GuidedDecodingParams(json={"type": "object"}).guide() == Guide(GuideType.JSON_SCHEMA, '{"type": "object"}')
    assert GuidedDecodingParams(regex="a+").guide() == Guide(GuideType.REGEX, "a+")
    assert GuidedDecodingParams(grammar='root ::= "x"').guide() == Guide(GuideType.EBNF_GRAMMAR, 'root ::= "x"')
    assert GuidedDecodingParams(structural_tag="{}").guide() == Guide(GuideType.STRUCTURAL_TAG, "{}")
    assert GuidedDecodingParams().guide() is None
    with pytest.raises(GuideError, match="Only one guide can be used for a request, but got 2"):
        GuidedDecodingParams(regex="a", grammar="b").guide()


def test_triton_guide_names():
    assert Guide.of("json", None) == Guide(GuideType.JSON)
    assert Guide.of("ebnf_grammar", 'root ::= "x"').guide_type is GuideType.EBNF_GRAMMAR
    with pytest.raises(GuideError, match="'xml' is not one of json, json_schema, regex, ebnf_grammar"):
        Guide.of("xml", "x")
    with pytest.raises(GuideError, match="guided_decoding_guide is required for guide type 'regex'"):
        Guide.of("regex", "")


def test_no_backend_is_no_decoder_and_an_unknown_one_is_refused(tokenizer):
    assert GuidedDecoder.from_tokenizer(None, tokenizer, VOCAB) is None
    with pytest.raises(ValueError, match="'outlines' is not one of xgrammar, llguidance"):
        GuidedDecoder.from_tokenizer("outlines", tokenizer, VOCAB)


def test_upstream_tokenizer_info_gives_xgrammars_own_masks(tokenizer):
    """The tokenizer-info triple (generate_xgrammar_tokenizer_info.py) read back as XGrammarMatcherFactory reads it
    allows exactly what xgrammar's own TokenizerInfo.from_huggingface allows, along a random walk of allowed tokens."""
    data = json.loads(json.dumps(upstream_tokenizer_info(tokenizer)))  # through the file format
    assert data["stop_token_ids"] == [EOS] and len(data["encoded_vocab"]) == VOCAB
    ours = GuidedDecoder("xgrammar", data, VOCAB).matcher(_schema_guide(SCHEMAS["nested"]))
    theirs = xgr.GrammarMatcher(hf_compiled(tokenizer, VOCAB, SCHEMAS["nested"]))
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        theirs.fill_next_token_bitmask(mask)
        logits = torch.zeros(1, VOCAB)
        xgr.apply_token_bitmask_inplace(logits, mask)  # xgrammar's own reading of its bitmask
        allowed = ours.allowed()
        assert torch.equal(allowed, logits[0] == 0)
        choices = allowed.nonzero()[:, 0]
        tok = int(choices[torch.randint(len(choices), (1,), generator=g)])
        ours.accept(tok)
        assert theirs.accept_token(tok)
        if ours.terminated:
            break


# ---- the executor -----------------------------------------------------------------------------------------------


def test_bad_guide_fails_its_own_request_only(model_tp1, decoder, tokenizer):
    prompt = tokenizer.encode(PROMPT_TEXT)
    bad_schema = Guide(GuideType.JSON_SCHEMA, '{"type": "object", "properties": ')  # not JSON
    bad_regex = Guide(GuideType.REGEX, "([a-z")
    good = Request(prompt, 6, end_id=EOS, exclude_input_from_output=True)
    out = _serve(
        model_tp1,
        decoder,
        [Request(prompt, 6, guide=bad_schema), good, Request(prompt, 6, guide=bad_regex)],
    )
    assert out[0].error_kind is ErrorKind.INVALID and "invalid json_schema guide" in out[0].error
    assert out[2].error_kind is ErrorKind.INVALID and "invalid regex guide" in out[2].error
    assert not out[1].has_error and len(out[1].tokens) == 6
    assert decoder.stats.failed_guides >= 2


def test_guide_without_a_backend_is_refused(model_tp1, tokenizer):
    out = _serve(model_tp1, None, [Request(tokenizer.encode(PROMPT_TEXT), 4, guide=Guide(GuideType.JSON))])
    assert out[0].error_kind is ErrorKind.INVALID and "Guided decoding is not enabled" in out[0].error


def test_compile_cache_is_bounded_and_counts_hits(tokenizer):
    d = GuidedDecoder.from_tokenizer("xgrammar", tokenizer, VOCAB)
    d.cache_entries = 2
    guides = [Guide(GuideType.REGEX, r) for r in ("a+", "b+", "c+")]
    for g in guides + guides[2:]:
        d.matcher(g)
    assert (d.stats.compiles, d.stats.cache_hits, d.stats.constrained_requests) == (3, 1, 4)
    d.matcher(guides[0])  # evicted (least recently used): compiled again
    assert d.stats.compiles == 4
    text = "\n".join(d.prometheus_lines('model_name="m"'))
    assert 'trtpipe_guided_grammar_cache_hits_total{model_name="m"} 1' in text
    assert 'trtpipe_guided_requests_total{model_name="m"} 5' in text


@pytest.mark.parametrize(
    "guide, check",
    [
        (Guide(GuideType.REGEX, r"[a-z]{2,5}-[0-9]{3}"), lambda s: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", s)),
        (Guide(GuideType.EBNF_GRAMMAR, 'root ::= ("yes" | "no") "!"'), lambda s: s in ("yes!", "no!")),
        (Guide(GuideType.JSON), lambda s: json.loads(s, strict=False) is not None),
        (
            Guide(
                GuideType.STRUCTURAL_TAG,
                json.dumps(
                    {
                        "type": "structural_tag",
                        "format": {
                            "type": "tag",
                            "begin": "<a>",
                            "content": {"type": "regex", "pattern": "[0-9]+"},
                            "end": "</a>",
                        },
                    }
                ),
            ),
            lambda s: re.fullmatch(r"<a>[0-9]+</a>", s),
        ),
    ],
    ids=["regex", "ebnf", "json_object", "structural_tag"],
)
def test_every_guide_type_is_followed(synthetic, decoder, tokenizer, guide, check):
    model, _ = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    reqs = [
        Request(
            prompt,
            120,
            end_id=EOS,
            exclude_input_from_output=True,
            guide=guide,
            sampling=SamplingParams(1.0, 0, 1.0, seed),
        )
        for seed in range(4)
    ]
    ended = 0
    for r in _serve(model, decoder, reqs):  # an unbounded JSON string may run to the length limit: then not checked
        assert not r.has_error and r.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH), r.error
        if r.finish_reason == FinishReason.END_ID:
            ended += 1
            assert check(tokenizer.decode(r.tokens)), tokenizer.decode(r.tokens)
    assert ended >= 1


def test_greedy_equals_transformers_with_xgrammar_stories(model_tp1, oracle, decoder, tokenizer):
    """stories260k, every schema at once in one in-flight batch, next to an unguided request (unchanged)."""
    prompt = tokenizer.encode(PROMPT_TEXT)
    n = 40
    reqs = [
        Request(prompt, n, end_id=EOS, exclude_input_from_output=True, guide=_schema_guide(s)) for s in SCHEMAS.values()
    ]
    reqs.append(Request(prompt, n, end_id=EOS, exclude_input_from_output=True))
    out = _serve(model_tp1, decoder, reqs)
    for (name, schema), r in zip(SCHEMAS.items(), out):
        assert not r.has_error, r.error
        assert check_guided_greedy(model_tp1, oracle, tokenizer, VOCAB, prompt, schema, r.tokens, n, EOS) == "", name
    assert check_greedy(model_tp1, oracle, prompt, out[-1].tokens, n, EOS) == ""


def test_greedy_equals_transformers_with_xgrammar_synthetic(synthetic, decoder, tokenizer):
    """A random Llama with the real tokenizer: greedy walks through names, enums, array items, patterns and
    numbers to a complete document, token for token as transformers + xgrammar's logits processor do."""
    model, hf64 = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    n = 150
    out = _serve(
        model,
        decoder,
        [
            Request(prompt, n, end_id=EOS, exclude_input_from_output=True, guide=_schema_guide(s))
            for s in SCHEMAS.values()
        ],
    )
    completed = 0
    for (name, schema), r in zip(SCHEMAS.items(), out):
        assert not r.has_error, r.error
        assert check_guided_greedy(model, hf64, tokenizer, VOCAB, prompt, schema, r.tokens, n, EOS) == "", name
        if r.finish_reason == FinishReason.END_ID:
            completed += 1
            jsonschema.validate(json.loads(tokenizer.decode(r.tokens), strict=False), schema)
    assert completed >= 2  # the comparison covers complete documents, not only whitespace runs


def parse_strictly_or_note(text: str):
    """The document, parsed as RFC 8259 JSON, else with raw control characters in strings allowed: xgrammar
    0.2.9's schema grammars admit U+0000..U+001F inside strings (mlc-ai/xgrammar#286), which RFC 8259 forbids.
    Returns (document, strict)."""
    try:
        return json.loads(text), True
    except json.JSONDecodeError:
        return json.loads(text, strict=False), False


def test_sampled_outputs_are_valid(synthetic, decoder, tokenizer):
    """Sampled (temperature 1, seeded) outputs that end by the grammar are valid against their schema, 100 %."""
    model, _ = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    reqs, schemas = [], []
    for schema in SCHEMAS.values():
        for seed in range(6):
            reqs.append(
                Request(
                    prompt,
                    200,
                    end_id=EOS,
                    exclude_input_from_output=True,
                    sampling=SamplingParams(1.0, 0, 1.0, seed),
                    guide=_schema_guide(schema),
                )
            )
            schemas.append(schema)
    out = _serve(model, decoder, reqs)
    for r, schema in zip(out, schemas):
        assert r.finish_reason == FinishReason.END_ID, tokenizer.decode(r.tokens)
        doc, _ = parse_strictly_or_note(tokenizer.decode(r.tokens))
        jsonschema.validate(doc, schema)


# ---- the llguidance backend ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llg_decoder(tokenizer):
    pytest.importorskip("llguidance")
    return GuidedDecoder.from_tokenizer("llguidance", tokenizer, VOCAB)


@pytest.mark.slow  # ~8 s: transformers generates once per schema
def test_llguidance_greedy_equals_transformers_with_llguidance(synthetic, llg_decoder, tokenizer):
    """The llguidance backend, through the same matcher interface: greedy equals transformers + llguidance's own
    mask token for token, on every schema in one in-flight batch. (Not the xgrammar path's tokens: the two
    backends' JSON grammars admit different whitespace and token splits, so their greedy walks part.)"""
    model, hf64 = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    n = 150
    reqs = [
        Request(prompt, n, end_id=EOS, exclude_input_from_output=True, guide=_schema_guide(s)) for s in SCHEMAS.values()
    ]
    out = _serve(model, llg_decoder, reqs)
    completed = 0
    for (name, schema), r in zip(SCHEMAS.items(), out):
        assert not r.has_error, r.error
        why = check_guided_greedy(model, hf64, tokenizer, VOCAB, prompt, schema, r.tokens, n, EOS, "llguidance")
        assert why == "", name
        if r.finish_reason == FinishReason.END_ID:
            completed += 1
            jsonschema.validate(json.loads(tokenizer.decode(r.tokens)), schema)
    assert completed >= 2


def test_llguidance_sampled_outputs_are_valid(synthetic, llg_decoder, tokenizer):
    """Sampled outputs that end by the grammar are valid against their schema, 100 %, and strict JSON."""
    model, _ = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    reqs, schemas = [], []
    for schema in SCHEMAS.values():
        for seed in range(6):
            reqs.append(
                Request(
                    prompt,
                    200,
                    end_id=EOS,
                    exclude_input_from_output=True,
                    sampling=SamplingParams(1.0, 0, 1.0, seed),
                    guide=_schema_guide(schema),
                )
            )
            schemas.append(schema)
    out = _serve(model, llg_decoder, reqs)
    ended = 0
    for r, schema in zip(out, schemas):
        assert not r.has_error and r.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH), r.error
        if r.finish_reason == FinishReason.END_ID:
            ended += 1
            jsonschema.validate(json.loads(tokenizer.decode(r.tokens)), schema)
    assert ended >= len(reqs) // 2, ended


@pytest.mark.parametrize(
    "guide, check",
    [
        (Guide(GuideType.REGEX, r"[a-z]{2,5}-[0-9]{3}"), lambda s: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", s)),
        (Guide(GuideType.EBNF_GRAMMAR, 'start: ("yes" | "no") "!"'), lambda s: s in ("yes!", "no!")),  # Lark
        (Guide(GuideType.JSON), lambda s: isinstance(json.loads(s), dict)),
    ],
    ids=["regex", "lark", "json_object"],
)
def test_llguidance_guide_types(synthetic, llg_decoder, tokenizer, guide, check):
    model, _ = synthetic
    prompt = tokenizer.encode(PROMPT_TEXT)
    reqs = [
        Request(
            prompt,
            120,
            end_id=EOS,
            exclude_input_from_output=True,
            guide=guide,
            sampling=SamplingParams(1.0, 0, 1.0, s),
        )
        for s in range(4)
    ]
    ended = 0
    for r in _serve(model, llg_decoder, reqs):
        assert not r.has_error and r.finish_reason in (FinishReason.END_ID, FinishReason.LENGTH), r.error
        if r.finish_reason == FinishReason.END_ID:
            ended += 1
            assert check(tokenizer.decode(r.tokens)), tokenizer.decode(r.tokens)
    assert ended >= 1


def test_llguidance_refuses_a_structural_tag_and_a_bad_guide(model_tp1, llg_decoder, tokenizer):
    prompt = tokenizer.encode(PROMPT_TEXT)
    tag = Guide(
        GuideType.STRUCTURAL_TAG, '{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'
    )
    bad = Guide(GuideType.REGEX, "([a-z")
    good = Request(prompt, 4, end_id=EOS, exclude_input_from_output=True)
    out = _serve(model_tp1, llg_decoder, [Request(prompt, 4, guide=tag), good, Request(prompt, 4, guide=bad)])
    assert out[0].error_kind is ErrorKind.INVALID and "takes no structural_tag guide" in out[0].error
    assert out[2].error_kind is ErrorKind.INVALID and "invalid regex guide" in out[2].error
    assert not out[1].has_error and len(out[1].tokens) == 4
