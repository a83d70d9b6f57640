"""PEFT LoRA adapters made offline on stories260k with peft itself (the fixtures of the LoRA tests and benchmark).

peft initialises lora_B to zero (an adapter that changes nothing); these draw A and B at random so every delta
matters: A ~ N(0, 1/in), B ~ N(0, (gain / scaling)^2 / r), so a targeted linear's delta has about ``gain`` times the
size of its input whatever the rank and scaling.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ATTENTION + ("gate_proj", "up_proj", "down_proj")

# name -> (r, lora_alpha, targets, use_rslora): ranks 8 and 64, attention-only and all-linear, one rsLoRA
ADAPTERS = {
    "r8-attn": (8, 16, ATTENTION, False),
    "r64-all": (64, 32, ALL_LINEAR, False),
    "r8-all-rslora": (8, 8, ALL_LINEAR, True),
    "r64-attn-rslora": (64, 16, ("q_proj", "v_proj"), True),
}


def make_adapter(
    base_dir: Path, out: Path, r: int, alpha: float, targets, use_rslora: bool, seed: int, gain: float = 0.3
) -> Path:
    """Write a PEFT adapter of ``base_dir`` into ``out`` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model

    from trtpipe.models.synthetic import load_hf

    base = load_hf(base_dir)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * gain / scaling / math.sqrt(p.shape[1]))
    model.save_pretrained(str(out))
    return Path(out)


def make_all(base_dir: Path, root: Path) -> dict[str, Path]:
    """Every adapter of :data:`ADAPTERS` under ``root``/<name>."""
    return {
        name: make_adapter(base_dir, Path(root) / name, r, alpha, targets, rslora, seed=i + 1)
        for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items())
    }


def peft_model(base_dir: Path, adapter_dir: Path, dtype=torch.float64, merged: bool = False):
    """peft on transformers: the oracle (unmerged LoRA layers, or merged into the base weights)."""
    from peft import PeftModel

    from trtpipe.models.synthetic import load_hf

    model = PeftModel.from_pretrained(load_hf(base_dir).to(dtype), str(adapter_dir)).to(dtype).eval()
    return model.merge_and_unload() if merged else model


# The engine target's adapters on stories260k: ranks below every targeted module's sizes (k/v out 32), since
# hf_lora_convert.py writes a wrong rank above them (rank 64 is refused for target: engine here).
ENGINE_ADAPTERS = {
    "r8-attn": ADAPTERS["r8-attn"],
    "r8-all-rslora": ADAPTERS["r8-all-rslora"],
    "r16-mlp": (16, 32, ("gate_proj", "up_proj", "down_proj"), False),
}
SENT_ADAPTER = ("r4-qv", (4, 8, ("q_proj", "v_proj"), False))  # sent with a request, not prefetched


def make_engine_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """:data:`ENGINE_ADAPTERS` and :data:`SENT_ADAPTER` under ``root``/<name>."""
    items = [*ENGINE_ADAPTERS.items(), SENT_ADAPTER]
    return {
        name: make_adapter(base_dir, Path(root) / name, r, alpha, targets, rslora, seed=10 + i)
        for i, (name, (r, alpha, targets, rslora)) in enumerate(items)
    }


def build_lora_engine(base_dir: Path, adapters: dict[str, Path], root: Path, **sections):
    """(recipe, engine artifact, repo artifact) of a real ``target: engine`` build of ``base_dir`` (float32) with
    ``adapters`` (their task ids: their order), through the repo stage (the CPU twin engine without TensorRT-LLM)."""
    import yaml

    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe
    from trtpipe.pipeline.runner import run_build

    doc = {
        "name": "stories-lora-engine",
        "target": "engine",
        "work_dir": str(Path(root) / "work"),
        "model": {"source": str(base_dir), "dtype": "float32"},
        "accuracy": {"enabled": False},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 2048},
        "triton": {"max_batch_size": 8},
        "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, "max_lora_rank": 64, "max_loras": 2},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    path = Path(root) / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    recipe = load_recipe(path, check_rules=False)
    result = run_build(recipe, STAGES, quiet=True)
    return recipe, result.artifact("engine"), result.artifact("repo")
