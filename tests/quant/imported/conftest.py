"""Fixtures for pre-quantized sources: trtpipe's own unified HF and compressed-tensors exports of stories260k,
made once per session from one bf16 checkpoint and one calibration (group 32 for the AWQ search)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numerics import suite_threads

# recipe algo -> (kv cache, exclude) of each unified export used as a source; int4 keeps mlp.proj (in 172) float, and
# attention.dense too: at tp 2 a rank has 32 of its 64 inputs, half a group of 64 (the engine GEMM's smallest)
EXPORTS = {
    "fp8": ("fp8", ["*lm_head"]),
    "none": ("fp8", ["*lm_head"]),  # an FP8 KV cache alone
    "fp8_pc_pt": ("none", ["*lm_head"]),
    "int8_wo": ("none", ["*lm_head"]),
    "int4_wo": ("none", ["*lm_head", "*mlp.proj", "*attention.dense"]),
    "int4_awq": ("none", ["*lm_head", "*mlp.proj", "*attention.dense"]),
    "w4a8_awq": ("none", ["*lm_head", "*mlp.proj", "*attention.dense"]),
    "nvfp4": ("none", ["*lm_head", "*mlp.proj"]),
}
CT_EXPORTS = {"fp8": ["*lm_head"], "fp8_pc_pt": ["*lm_head"], "int4_wo": ["*lm_head", "*mlp.proj"]}
GROUP = 64  # the engine's group-wise INT4 GEMM runs 64 or 128 (trtpipe.engine.upstream)


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(suite_threads())


@pytest.fixture(scope="session")
def import_base(tmp_path_factory, stories_dir):
    from quant_helpers import our_stats, self_tokens
    from trtpipe.checkpoint.convert import convert

    root = tmp_path_factory.mktemp("imported")
    base = convert(stories_dir, root / "base", tp=1, dtype="bfloat16")
    stats = our_stats(base, self_tokens(base, 8, 32, 0), root / "stats", awq_group_size=GROUP)
    return {"base": base, "stats": stats, "root": root, "hf": stories_dir}


@pytest.fixture(scope="session")
def unified(import_base):
    """algo -> a unified HF export of stories260k (made lazily, once)."""
    from trtpipe.export.unified import export_unified

    made: dict[str, Path] = {}

    def get(algo: str) -> Path:
        if algo not in made:
            kv, exclude = EXPORTS[algo]
            out = import_base["root"] / f"unified-{algo}"
            out.mkdir()
            export_unified(
                import_base["base"],
                import_base["hf"],
                import_base["stats"],
                out,
                algo=algo,
                kv_cache=kv,
                group_size=GROUP,
                alpha=0.5,
                exclude=exclude,
            )
            made[algo] = out
        return made[algo]

    return get


@pytest.fixture(scope="session")
def compressed(import_base):
    """algo -> a compressed-tensors export of stories260k (made lazily, once)."""
    from trtpipe.export.compressed import export_compressed

    made: dict[str, Path] = {}

    def get(algo: str) -> Path:
        if algo not in made:
            out = import_base["root"] / f"ct-{algo}"
            out.mkdir()
            export_compressed(
                import_base["base"],
                import_base["hf"],
                import_base["stats"],
                out,
                algo=algo,
                kv_cache="none",
                group_size=GROUP,
                alpha=0.5,
                exclude=CT_EXPORTS[algo],
            )
            made[algo] = out
        return made[algo]

    return get
