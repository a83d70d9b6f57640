"""Runtime fixtures: stories260k converted once (tp=2 x pp=2, float32) and its HF oracle."""

from __future__ import annotations

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.runtime import load_checkpoint
from numerics import suite_threads


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(suite_threads())


@pytest.fixture(scope="session")
def stories_ckpt(tmp_path_factory, stories_dir):
    return convert(stories_dir, tmp_path_factory.mktemp("rt") / "ckpt", tp=2, pp=2, dtype="float32")


@pytest.fixture(scope="session")
def stories_model(stories_ckpt):
    return load_checkpoint(stories_ckpt)


@pytest.fixture(scope="session")
def stories_hf(stories_dir):
    from trtpipe.models.synthetic import load_hf

    return load_hf(stories_dir)


@pytest.fixture(scope="session")
def stories_hf64(stories_hf):
    """The same transformers model in float64: the reference that float32 tolerances are measured against."""

    from numerics import hf_float64

    return hf_float64(stories_hf)
