"""Helpers shared by the recipe tests (a uniquely named module: tests/ folders have no __init__.py)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from trtpipe.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = REPO_ROOT / "recipes"
MIXTRAL = RECIPES / "configs" / "mixtral-8x7b"


def llama_config(**overrides) -> dict:
    """A Llama config.json with stories260k's shapes, changed where a test needs another head layout."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 5,
        "vocab_size": 512,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    }
    cfg.update(overrides)
    return cfg


def run_cli(*args: str):
    """Run `trtpipe ARGS` in-process; return click's Result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False)
