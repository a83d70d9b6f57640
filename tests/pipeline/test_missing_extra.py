"""A missing optional extra is one line naming the extra to install, a non-zero exit and nothing written.

Absence is simulated in a fresh interpreter: ``sys.modules[name] = None`` makes ``import name`` fail exactly as
an uninstalled package does (ModuleNotFoundError naming it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trtpipe in a child process per case

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "stories-fp16.yaml"


def run_without(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"
        "from trtpipe.cli import main\n"
        f"main({list(args)!r}, prog_name='trtpipe')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize(
    "module,args,line",
    [
        (
            "matplotlib",
            ["report", str(RECIPE), "--out", "out"],
            "trtpipe report needs matplotlib: pip install 'trtpipe[bench]'",
        ),
        (
            "tritonclient",
            ["infer", "hello", "--url", "127.0.0.1:9"],
            "a Triton client (trtpipe infer, bench) needs tritonclient: pip install 'trtpipe[serve]'",
        ),
        (
            "aiohttp",
            ["serve-openai", "{stories}"],
            "the OpenAI twin (trtpipe serve of an llmapi target) needs aiohttp (with tritonclient[all]): "
            "pip install 'trtpipe[serve]'",
        ),
    ],
)
def test_missing_extra_is_one_line_naming_it(tmp_path, stories_dir, module, args, line):
    args = [a.replace("{stories}", str(stories_dir)) for a in args]
    done = run_without(module, *args, cwd=tmp_path)
    assert (done.returncode, done.stderr, done.stdout) == (1, line + "\n", "")
    assert list(tmp_path.iterdir()) == []  # nothing written (report's --out not even created)


def test_plan_plot_without_matplotlib_fails_before_simulating(tmp_path):
    done = run_without(
        "matplotlib",
        "plan",
        str(REPO / "recipes" / "llama70b-fp8.yaml"),
        "--slo",
        "ttft_p99=500ms",
        "--rate",
        "1",
        "--plot",
        "plan.png",
        cwd=tmp_path,
    )
    assert (done.returncode, done.stderr) == (1, "trtpipe plan --plot needs matplotlib: pip install 'trtpipe[bench]'\n")
    assert list(tmp_path.iterdir()) == []
