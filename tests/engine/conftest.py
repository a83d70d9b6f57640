"""Fixtures for the engine tests: recipes written into tmp_path, the trtllm-build flag tables of docs/reference."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine_helpers import BUILD_REFERENCE, hf_config


@pytest.fixture(scope="session")
def contract_flags() -> set[str]:
    """Every ``--flag`` named in the 1.2.x trtllm-build flag tables (docs/reference/trtllm-build.md)."""
    if not BUILD_REFERENCE.is_file():
        pytest.fail(f"the trtllm-build reference is missing: {BUILD_REFERENCE}")
    text = BUILD_REFERENCE.read_text()
    section = text[text.index("## General flags") : text.index("## Builder-enforced combinations")]
    flags = set(re.findall(r"`(--[a-z0-9_]+)", section))
    flags |= set(re.findall(r"(?<=[`, ])(--[a-z0-9_]+)", section))
    removed = {"--auto_parallel", "--gpus_per_node", "--cluster_key"}  # "<=1.0 only: removed in 1.1+"
    return flags - removed


@pytest.fixture
def make_recipe(tmp_path):
    """Write a recipe YAML (a model dir holding only a config.json) and return its path."""

    def make(body: str, config: dict | str = "llama-3-8b", name: str = "r") -> Path:
        model = tmp_path / f"model-{name}"
        model.mkdir(exist_ok=True)
        cfg = hf_config(config) if isinstance(config, str) else config
        (model / "config.json").write_text(json.dumps(cfg))
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"name: {name}\nmodel:\n  source: {model}\n" + body)
        return path

    return make
