"""Fixtures for the llmapi target: stories260k converted once, calibration statistics collected once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))  # quant_helpers (our_stats, self_tokens)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny models: threads only fight the other test processes for the 2 cores
