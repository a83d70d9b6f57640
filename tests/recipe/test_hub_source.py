"""hf:// sources: validation reads only config.json from the Hugging Face cache (real huggingface_hub, offline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipe_helpers import llama_config

pytestmark = pytest.mark.slow  # trtpipe validate in a child process


def _validate(tmp_path, source: str) -> subprocess.CompletedProcess:
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(llama_config()))
    (cache / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\nmodel:\n  source: {source}\nparallel:\n  tp: 2\n")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", "validate", str(recipe)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cached_hub_model_validates_offline(tmp_path):
    proc = _validate(tmp_path, "hf://tiny-org/tiny-llama")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("r.yaml: ok\n")


def test_uncached_hub_model_is_one_line_error(tmp_path):
    proc = _validate(tmp_path, "hf://tiny-org/not-downloaded")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"{tmp_path / 'r.yaml'}:3:11: model.source: cannot fetch config.json of hf://tiny-org/not-downloaded: "
    )
