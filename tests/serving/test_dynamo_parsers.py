"""The Dynamo twin's workers carry the recipe's parsers in Dynamo's names, and hand them to Dynamo's WorkerConfig
(whose registration gives them to the frontend, which parses tool calls and reasoning for every backend)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PY = ROOT / ".venv-dynamo" / "bin" / "python"
QWEN3 = ROOT / "recipes" / "qwen3-32b-fp8.yaml"


def test_worker_command_carries_the_recipes_dynamo_parsers(tmp_path):
    from trtpipe.app.launch_dynamo import DynamoGraph, recipe_parser_args
    from trtpipe.serving.config import twin_default

    args = recipe_parser_args(QWEN3, ["target=llmapi"])
    assert args == ["--dyn-tool-call-parser", "qwen3", "--dyn-reasoning-parser", "qwen3"]
    assert recipe_parser_args(tmp_path, []) == []  # an HF directory: none, as trtllm-serve without flags
    g = DynamoGraph(tmp_path, "m", 1, "kv", "127.0.0.1", 8000, twin_default(64), tmp_path, parser_args=args)
    cmd = g.worker_command(Path("python"), 0)
    assert cmd[cmd.index("--dyn-tool-call-parser") + 1] == "qwen3"


@pytest.mark.skipif(not DYNAMO_PY.is_file(), reason="NVIDIA Dynamo is installed in .venv-dynamo")
def test_worker_args_reach_dynamos_worker_config():
    code = (
        "import asyncio, json, sys; from trtpipe.serving.dynamo_worker import TwinEngine; "
        "e, w = asyncio.run(TwinEngine.from_args(sys.argv[1:])); "
        "print(json.dumps([w.tool_call_parser, w.reasoning_parser]))"
    )
    cfg = json.dumps({"max_batch_size": 1, "max_num_tokens": 8, "max_input_len": 4, "max_seq_len": 8, "num_blocks": 1})
    argv = ["--model", "/nonexistent", "--served-model-name", "m", "--executor-config", cfg]
    argv += ["--dyn-tool-call-parser", "llama3_json", "--dyn-reasoning-parser", "deepseek_r1"]
    out = subprocess.run(
        [str(DYNAMO_PY), "-c", code, *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["llama3_json", "deepseek_r1"]


def _netns_works() -> bool:
    import shutil

    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not DYNAMO_PY.is_file(), reason="NVIDIA Dynamo is installed in .venv-dynamo")
def test_dynamos_frontend_splits_reasoning_with_the_workers_parser():
    """deepseek_r1 treats everything before </think> as reasoning: Dynamo's answer is the raw text, moved whole into
    reasoning_content (without the parser it would be the content)."""
    import sys

    if not _netns_works():
        pytest.skip("unshare -rn (a user + network namespace) is not permitted here")
    script = ROOT / "tests" / "tools" / "dynamo_parsers_check.py"
    inner = f"ip link set lo up && exec {sys.executable} {script} 8123"
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["raw"] and out["message"]["reasoning_content"] == out["raw"]
    assert not out["message"]["content"]
