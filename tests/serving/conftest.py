"""Serving fixtures: stories260k as float32 checkpoints (tp1, tp2) and a float64 transformers oracle."""

from __future__ import annotations

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.runtime import load_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_tp1(tmp_path_factory, stories_dir):
    return load_checkpoint(convert(stories_dir, tmp_path_factory.mktemp("srv") / "tp1", tp=1, pp=1, dtype="float32"))


@pytest.fixture(scope="session")
def model_tp2(tmp_path_factory, stories_dir):
    return load_checkpoint(convert(stories_dir, tmp_path_factory.mktemp("srv") / "tp2", tp=2, pp=1, dtype="float32"))


@pytest.fixture(scope="session")
def oracle(stories_dir):
    from trtpipe.models.synthetic import load_hf

    return load_hf(stories_dir).double()
