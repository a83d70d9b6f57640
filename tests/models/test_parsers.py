"""Tool and reasoning parser names: the table against Dynamo's own lists, the recipe keys refused one line each,
and the flags written into serve.sh and the Dynamo worker arguments."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trtpipe.app.validation import load_recipe
from trtpipe.deploy.dynamo import dynamo_parser_args
from trtpipe.errors import RecipeError
from trtpipe.export.serving import serve_command
from trtpipe.models.parsers import OFF, REASONING_PARSERS, TOOL_PARSERS, default_parsers, names, problem

REPO = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = REPO / ".venv-dynamo" / "bin" / "python"
STORIES = REPO / "recipes" / "stories-llmapi-fp8.yaml"
QWEN3 = REPO / "recipes" / "qwen3-32b-fp8.yaml"
LLAMA31 = REPO / "recipes" / "llama-3.1-70b-fp8-llmapi.yaml"


@pytest.mark.skipif(not DYNAMO_PYTHON.exists(), reason="ai-dynamo 1.6.1 is installed in .venv-dynamo")
def test_dynamo_spellings_are_the_wheels_own():
    """Every Dynamo spelling in the table is a choice of the installed 1.6.1 wheel's --dyn-*-parser flags."""
    out = subprocess.run(
        [
            str(DYNAMO_PYTHON),
            "-c",
            "import json, importlib.metadata as m; from dynamo._core import get_tool_parser_names as t, "
            "get_reasoning_parser_names as r; print(json.dumps([m.version('ai-dynamo'), t(), r()]))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    version, tools, reasoning = json.loads(out.stdout)
    assert version == "1.6.1"
    assert {p.dynamo for p in TOOL_PARSERS if p.dynamo} <= set(tools)
    assert {p.dynamo for p in REASONING_PARSERS if p.dynamo} <= set(reasoning)


def test_family_defaults():
    assert default_parsers("qwen3") == ("qwen3", "qwen3")
    assert default_parsers("llama", vocab_size=128256) == ("llama3_json", None)  # Llama 3.x
    assert default_parsers("llama", vocab_size=32000) == (None, None)  # Llama 2: no tool-call format
    assert default_parsers("gpt_oss") == ("harmony", "gpt_oss")
    # DeepSeek-V3 and R1 share a model_type: only R1 reasons (TensorRT-LLM's resolve_auto_reasoning_parser)
    assert default_parsers("deepseek_v3", "DeepSeek-V3-0324") == ("deepseekv3", None)
    assert default_parsers("deepseek_v3", "DeepSeek-R1-0528") == ("deepseekv3", "deepseek-r1")


def test_problem_lines():
    assert problem("tool_parser", "qwen3", "1.2") is None
    assert problem("tool_parser", OFF, "1.2") is None
    unknown = problem("tool_parser", "hermes", "1.2")
    assert "'hermes' is not a tool parser" in unknown and ", ".join(names("tool_parser")) in unknown
    assert "trtllm-serve (it has: qwen3, qwen3_coder" in problem("tool_parser", "llama3_json", "1.2")
    assert "1.2 only" in problem("reasoning_parser", "qwen3", "1.1")


@pytest.mark.parametrize(
    "override, key, pattern",
    [
        ("serving.tool_parser=hermes", "serving.tool_parser", "'hermes' is not a tool parser of TensorRT-LLM 1.2"),
        ("serving.reasoning_parser=deepseek_r1", "serving.reasoning_parser", "one of: deepseek-r1, qwen3, gpt_oss"),
        ("serving.tool_parser=harmony", "serving.tool_parser", "is not in TensorRT-LLM 1.2's trtllm-serve"),
    ],
)
def test_validate_refuses_names_the_release_lacks(override, key, pattern):
    with pytest.raises(RecipeError) as err:
        load_recipe(STORIES, [override])
    lines = [line for line in str(err.value).splitlines() if key in line]
    assert len(lines) == 1 and pattern in lines[0], str(err.value)


def test_serve_sh_and_dynamo_args_of_a_qwen3_recipe():
    recipe = load_recipe(QWEN3, ["target=llmapi"])
    cmd = serve_command(recipe, "/m", "/c.yaml")
    assert cmd[cmd.index("--tool_parser") + 1] == "qwen3"
    assert cmd[cmd.index("--reasoning_parser") + 1] == "qwen3"
    assert dynamo_parser_args(recipe) == ["--dyn-tool-call-parser", "qwen3", "--dyn-reasoning-parser", "qwen3"]


def test_llama_defaults_reach_dynamo_only_and_none_turns_off():
    recipe = load_recipe(LLAMA31)  # Llama 3.1: trtllm-serve 1.2 has no Llama tool parser; Dynamo has llama3_json
    assert "--tool_parser" not in serve_command(recipe, "/m", "/c.yaml")
    assert dynamo_parser_args(recipe) == ["--dyn-tool-call-parser", "llama3_json"]
    off = load_recipe(LLAMA31, ["serving.tool_parser=none"])
    assert dynamo_parser_args(off) == []
    assert dynamo_parser_args(load_recipe(STORIES)) == []  # a Llama-2-style vocabulary: no default
    named = load_recipe(STORIES, ["serving.tool_parser=qwen3", "serving.reasoning_parser=deepseek-r1"])
    cmd = serve_command(named, "/m", "/c.yaml")
    assert cmd[-4:] == ["--tool_parser", "qwen3", "--reasoning_parser", "deepseek-r1"]
    assert dynamo_parser_args(named) == ["--dyn-tool-call-parser", "qwen3", "--dyn-reasoning-parser", "deepseek_r1"]
    old = load_recipe(STORIES, ["llmapi.version='1.1'"])  # parser names were read for 1.2 only: none written
    assert "--tool_parser" not in serve_command(old, "/m", "/c.yaml")


def test_the_twin_runs_what_trtllm_serve_would():
    from trtpipe.app.launch_openai import twin_parser
    from trtpipe.export.serving import served_parsers

    qwen = {k: twin_parser(p) for k, p in served_parsers(load_recipe(QWEN3, ["target=llmapi"])).items()}
    assert qwen == {"tool_parser": "qwen3", "reasoning_parser": "qwen3"}
    llama = {k: twin_parser(p) for k, p in served_parsers(load_recipe(STORIES)).items()}
    assert llama == {"tool_parser": None, "reasoning_parser": None}  # llama3_json is Dynamo's, not trtllm-serve's
    # every parser a generated deployment runs, the twin runs too (gpt-oss's: trtllm-serve's harmony adapter)
    for recipe, expected in [
        ("gpt-oss-20b-mxfp4", {"tool_parser": "harmony", "reasoning_parser": "gpt_oss"}),
        ("kimi-k2-instruct-fp8", {"tool_parser": "kimi_k2", "reasoning_parser": None}),
        ("deepseek-r1-0528-fp8", {"tool_parser": "deepseekv3", "reasoning_parser": "deepseek-r1"}),
    ]:
        got = {k: twin_parser(p) for k, p in served_parsers(load_recipe(REPO / "recipes" / f"{recipe}.yaml")).items()}
        assert got == expected, recipe


def test_every_parser_trtllm_serve_runs_is_run_by_the_twin():
    """No name the artifacts can carry into trtllm-serve (by flag or by itself) is answered unsplit by the twin."""
    from trtpipe.serving.reasoning import PARSERS as REASONING
    from trtpipe.serving.tool_calls import FORMATS

    for kind, table, twin in (("tool", TOOL_PARSERS, FORMATS), ("reasoning", REASONING_PARSERS, REASONING)):
        for p in table:
            assert p.twin == ((p.trtllm or p.name) in twin), (kind, p.name)
    assert all(p.twin for p in TOOL_PARSERS + REASONING_PARSERS if p.trtllm or p.builtin)
