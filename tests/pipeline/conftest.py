"""Fixtures for the pipeline tests: a copy of the tiny model, recipes on it, and a build driver process."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
BIG_FILE_BYTES = 3 << 19  # 1.5 MiB: above the 1 MiB content-hash limit, so fingerprinted by size and mtime

DRIVER = f"""\
import json, sys
sys.path.insert(0, {str(HERE)!r})
from pipeline_test_stages import STAGES

if sys.argv[1] == "lib":  # lib RECIPE KWARGS_JSON: run_build directly (no cross-field rules, no CLI)
    from trtpipe.pipeline.runner import run_build
    from trtpipe.app.validation import load_recipe

    result = run_build(load_recipe(sys.argv[2], check_rules=False), STAGES, quiet=True, **json.loads(sys.argv[3]))
    print(json.dumps(result.summary()))
else:  # the real CLI, with the test stages
    from trtpipe.cli import main

    main(sys.argv[1:], obj={{"stages": STAGES}}, prog_name="trtpipe")
"""


@pytest.fixture
def model_dir(tmp_path: Path, stories_dir: Path) -> Path:
    """A writable copy of the tiny model (tests change its files), plus one file too big to content-hash."""
    out = tmp_path / "model"
    out.mkdir()
    for name in MODEL_FILES:
        shutil.copyfile(stories_dir / name, out / name)
    (out / "extra.bin").write_bytes(random.Random(7).randbytes(BIG_FILE_BYTES))
    return out


@pytest.fixture
def make_recipe(tmp_path: Path, model_dir: Path):
    """``make_recipe(name="r", work_dir="work", body="")`` writes a recipe on the model copy; returns its path."""

    def make(name: str = "r", work_dir: str = "work", body: str = "") -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: {name}\nwork_dir: {work_dir}\nmodel:\n  source: {model_dir}\n{body}")
        return path

    return make


@pytest.fixture
def driver(tmp_path: Path):
    """``driver(*cli_args, env=..., wait=True)``: ``trtpipe`` with the test stages, in a child process.

    ``driver("lib", recipe, json.dumps(run_build_kwargs))`` calls ``run_build`` directly (faster: no rules).
    """
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)

    def run(*args: str, env: dict | None = None, wait: bool = True):
        full_env = {**os.environ, **(env or {})}
        cmd = [sys.executable, str(script), *map(str, args)]
        if wait:
            return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120)
        return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    return run
