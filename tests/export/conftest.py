"""Fixtures for the llmapi target: stories260k converted once, calibration statistics collected once."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny models: threads only fight the other test processes for the 2 cores


@pytest.fixture(scope="session")
def stories_export_base(tmp_path_factory, stories_dir):
    """stories260k as a bf16 TRT-LLM checkpoint (tp=2, so the export un-splits) plus calibration statistics
    (with the AWQ search at group 32): what the checkpoint and calibrate stages hand the export stage."""
    from quant_helpers import our_stats, self_tokens
    from trtpipe.checkpoint.convert import convert

    root = tmp_path_factory.mktemp("export_base")
    base = convert(stories_dir, root / "base", tp=2, dtype="bfloat16")
    calib = self_tokens(base, 8, 32, 0)
    return {"base": base, "stats": our_stats(base, calib, root / "stats", awq_group_size=32), "root": root}
