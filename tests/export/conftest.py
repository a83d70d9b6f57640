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


@pytest.fixture(scope="session")
def fp16_greedy_text(stories_fp16_export):
    """transformers' greedy continuation (float16 weights, float32 compute) of a prompt, as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories_fp16_export, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(stories_fp16_export)
    eos = model.generation_config.eos_token_id

    def run(prompt: str, n: int) -> str:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([tok.encode(prompt)]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        return tok.decode(out[0, len(tok.encode(prompt)) :].tolist(), skip_special_tokens=True)

    return run
