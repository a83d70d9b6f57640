"""Fixtures for recipe tests: write a recipe into tmp_path; make a model directory holding only config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_helpers import llama_config


@pytest.fixture
def write(tmp_path):
    """write(text, name="recipe.yaml") -> Path of a recipe file in tmp_path."""

    def _write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return _write


@pytest.fixture
def model_config(tmp_path):
    """model_config(name, **config) -> a directory holding only config.json (enough for validation)."""

    def _make(name: str, **cfg) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(llama_config(**cfg)))
        return d

    return _make
