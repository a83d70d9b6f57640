"""Fixtures for quantization tests: converted checkpoints of stories260k and calibration tokens, made once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from quant_helpers import self_tokens
from trtpipe.quant.data import load_tokenizer
from numerics import suite_threads


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(suite_threads())  # tiny models: threads only fight the other test processes for the 2 cores


@pytest.fixture(scope="session")
def stories_ckpts(tmp_path_factory, stories_dir) -> dict[int, Path]:
    """Unquantized bf16 TRT-LLM checkpoints of stories260k at tp=1 and tp=2 (the checkpoint stage's output)."""
    root = tmp_path_factory.mktemp("stories_ckpt")
    return {tp: convert(stories_dir, root / f"tp{tp}", tp=tp, dtype="bfloat16") for tp in (1, 2)}


@pytest.fixture(scope="session")
def stories_tokens(stories_ckpts) -> dict[str, torch.Tensor]:
    """Calibration and held-out token batches of stories260k (different seeds)."""
    return {"calib": self_tokens(stories_ckpts[1], 16, 64, 0), "heldout": self_tokens(stories_ckpts[1], 8, 64, 1)}


@pytest.fixture(scope="session")
def stories_tokenizer(stories_dir):
    return load_tokenizer(stories_dir)
