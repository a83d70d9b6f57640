"""Helpers for the quantization and export tests: our pipeline on a checkpoint, ModelOpt 0.47.0 on the HF model,
error metrics. At tests/ root, like numerics.py: importable from every test directory (pytest puts tests/ on
sys.path for tests/conftest.py), with no sys.path edit."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from trtpipe.quant.data import batched_decode
from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
from trtpipe.quant.writer import TrtllmSource, quantize_checkpoint
from trtpipe.runtime import load_checkpoint

MODELOPT_CFG = {"fp8": "FP8_DEFAULT_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG", "int8_wo": "INT8_WEIGHT_ONLY_CFG",
                "int4_awq": "INT4_AWQ_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG"}


def our_stats(base: Path, tokens: torch.Tensor, out: Path, awq_group_size: Optional[int] = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    calibrate(TrtllmSource(base), tokens, CalibSettings(batch_size=8, awq_group_size=awq_group_size),
              on_layer=lambda i, st: save_layer_stats(out, i, st))
    return out


def our_quant(base: Path, source_base: Path, stats: Optional[Path], out: Path, algo: str, kv: str = "none",
              group_size: int = 128, exclude=("*lm_head",), alpha: float = 0.5) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    quantize_checkpoint(base, TrtllmSource(source_base), stats, out, algo=algo, kv_cache=kv, group_size=group_size,
                        alpha=alpha, exclude=list(exclude))
    return out


def modelopt_quant(mtq, export, hf_dir: Path, tokens: torch.Tensor, algo: str, out: Path,
                   block_size: Optional[int] = None, disable: tuple[str, ...] = ()) -> Path:
    """Drive ModelOpt on CPU as MODELOPT_LAYOUTS.md says: bf16 model, same batches, TRT-LLM export at tp=1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    cfg = copy.deepcopy(getattr(mtq, MODELOPT_CFG[algo]))
    for entry in cfg["quant_cfg"]:
        c = entry.get("cfg")
        for cc in c if isinstance(c, list) else [c]:
            if block_size and isinstance(cc, dict) and "block_sizes" in cc:
                cc["block_sizes"] = {-1: block_size, "type": "static"}
    for pattern in disable:
        cfg["quant_cfg"].append({"quantizer_name": pattern, "enable": False})

    def loop(m):
        with torch.no_grad():
            for b in tokens.split(8):
                m(b)

    mtq.quantize(model, cfg, loop)
    export(model, "llama", torch.bfloat16, out, inference_tensor_parallel=1)
    return out


def kl_to_reference(ref_logits: torch.Tensor, ckpt: Path, tokens: torch.Tensor) -> float:
    """Mean KL(reference || model) over every position of ``tokens`` on the reference runtime."""
    logits = load_checkpoint(ckpt)(tokens)
    p = F.log_softmax(ref_logits, -1)
    return (p.exp() * (p - F.log_softmax(logits, -1))).sum(-1).mean().item()


def self_tokens(ckpt: Path, n: int, seq_len: int, seed: int) -> torch.Tensor:
    """Text the model writes from BOS (token 1) with a fixed seed: [n, seq_len]."""
    model = load_checkpoint(ckpt)
    prompts = torch.ones(n, 1, dtype=torch.long)
    return torch.cat([prompts, batched_decode(model, prompts, seq_len - 1, 1.0, seed)], dim=1)
