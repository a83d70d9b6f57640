"""Dynamo's sampling_options.guided_decoding (ai-dynamo/dynamo lib/llm/src/protocols/common.rs@0ab24416) as the
executor's guide: the same mapping as the LLM API's GuidedDecodingParams; what TensorRT-LLM has no field for is
refused in one line; and an OpenAI response_format through Dynamo's real frontend answered by the worker's guided
decoding."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

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


def _dynamo_has_xgrammar(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import xgrammar"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_response_format_through_dynamos_frontend_is_answered_valid():
    """OpenAI ``response_format: json_schema`` sent to Dynamo's real frontend reaches the worker's guided decoding:
    every schema of tests/guided_oracle.py, 3 sampled seeds each, answered with a document valid against it."""
    import os
    import sys

    import jsonschema
    from guided_oracle import SCHEMAS

    root = Path(__file__).resolve().parents[2]
    dynamo_py = root / ".venv-dynamo" / "bin" / "python"
    if not dynamo_py.is_file() or not _dynamo_has_xgrammar(dynamo_py):
        pytest.skip("the worker runs in .venv-dynamo, which needs xgrammar (pip install xgrammar==0.2.9 there)")
    if subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True).returncode != 0:
        pytest.skip("unshare -rn (a user + network namespace) is not permitted here")
    script = root / "tests" / "tools" / "dynamo_guided_check.py"
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", f"ip link set lo up && exec {sys.executable} {script} 8124 xgrammar"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(answers) == 3 * len(SCHEMAS)
    for a in answers:
        assert a["finish"] == "stop", a
        jsonschema.validate(json.loads(a["text"], strict=False), SCHEMAS[a["schema"]])  # xgrammar#286: see test_guided
