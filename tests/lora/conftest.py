"""LoRA fixtures: PEFT adapters made with peft on stories260k (tests/lora_adapters.py), once per session."""

from __future__ import annotations

import pytest
import torch

from numerics import suite_threads


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(suite_threads())


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, stories_dir):
    from lora_adapters import make_all

    return make_all(stories_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="session")
def layout(stories_dir):
    from trtpipe.runtime.lora import BaseLayout

    return BaseLayout.of(stories_dir)
