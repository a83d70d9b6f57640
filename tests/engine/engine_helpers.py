"""Helpers shared by the engine tests (a uniquely named module: test dirs are not packages)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "recipes" / "configs"
STORIES = REPO / "models" / "stories260k"
BUILD_REFERENCE = REPO / "docs" / "reference" / "trtllm-build.md"  # the trtllm-build flag tables, with their sources


def hf_config(name: str) -> dict:
    """A real published config.json shipped under recipes/configs/."""
    return json.loads((CONFIGS / name / "config.json").read_text())


def write_checkpoint(d: Path, config: dict, world_size: int = 1) -> Path:
    """A minimal TensorRT-LLM checkpoint: config.json, rank{N}.safetensors (two real tensors each), tokenizer files."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    for r in range(world_size):
        save_file(
            {
                "transformer.ln_f.weight": torch.ones(config["hidden_size"], dtype=torch.float16),
                "lm_head.weight": torch.zeros(8, config["hidden_size"], dtype=torch.float16),
            },
            str(d / f"rank{r}.safetensors"),
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json"):
        src = STORIES / name
        (d / name).write_bytes(src.read_bytes())
    return d
