"""Dynamo's sampling_options.guided_decoding (ai-dynamo/dynamo lib/llm/src/protocols/common.rs@0ab24416) as the
executor's guide: the same mapping as the LLM API's GuidedDecodingParams; what TensorRT-LLM has no field for is
refused in one line."""

from __future__ import annotations

import json

import pytest

from trtpipe.serving.dynamo_requests import RequestRefused, translate
from trtpipe.serving.guided import Guide, GuideType


def _req(guided):
    return translate({"token_ids": [1, 2], "sampling_options": {"guided_decoding": guided}}, eos_id=2, max_seq_len=64)


def test_guided_decoding_options_become_the_executor_guide():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _req({"json": schema, "backend": "xgrammar"}).guide == Guide(GuideType.JSON_SCHEMA, json.dumps(schema))
    assert _req({"json": json.dumps(schema)}).guide == Guide(GuideType.JSON_SCHEMA, json.dumps(schema))
    assert _req({"regex": "[0-9]+"}).guide == Guide(GuideType.REGEX, "[0-9]+")
    assert _req({"grammar": 'root ::= "x"'}).guide == Guide(GuideType.EBNF_GRAMMAR, 'root ::= "x"')
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert _req({"structural_tag": tag}).guide == Guide(GuideType.STRUCTURAL_TAG, json.dumps(tag))
    assert _req(None).guide is None and _req({"choice": []}).guide is None


@pytest.mark.parametrize(
    "guided, message",
    [
        ({"choice": ["a", "b"]}, "guided_decoding.choice is not supported"),
        ({"whitespace_pattern": " *"}, "guided_decoding.whitespace_pattern is not supported"),
        ({"regex": "a", "grammar": "b"}, "Only one guide can be used for a request, but got 2"),
    ],
)
def test_what_tensorrt_llm_has_no_field_for_is_refused(guided, message):
    with pytest.raises(RequestRefused, match=message):
        _req(guided)
