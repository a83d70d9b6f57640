"""Helpers shared by the deploy tests (a uniquely named module: tests/ folders have no __init__.py)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from trtpipe.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes"
ONE_NODE = RECIPES / "llama70b-fp8.yaml"
MULTI_NODE = RECIPES / "llama-3.1-405b-fp8-tp8pp2.yaml"
DATA = Path(__file__).resolve().parent.parent / "data"


def run_cli(*args: str):
    """Run `trtpipe ARGS` in-process; return click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)
