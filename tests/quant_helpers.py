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

MODELOPT_CFG = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
}


def our_stats(base: Path, tokens: torch.Tensor, out: Path, awq_group_size: Optional[int] = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    calibrate(
        TrtllmSource(base),
        tokens,
        CalibSettings(batch_size=8, awq_group_size=awq_group_size),
        on_layer=lambda i, st: save_layer_stats(out, i, st),
    )
    return out


def our_quant(
    base: Path,
    source_base: Path,
    stats: Optional[Path],
    out: Path,
    algo: str,
    kv: str = "none",
    group_size: int = 128,
    exclude=("*lm_head",),
    alpha: float = 0.5,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    quantize_checkpoint(
        base,
        TrtllmSource(source_base),
        stats,
        out,
        algo=algo,
        kv_cache=kv,
        group_size=group_size,
        alpha=alpha,
        exclude=list(exclude),
    )
    return out


def modelopt_quant(
    mtq,
    export,
    hf_dir: Path,
    tokens: torch.Tensor,
    algo: str,
    out: Path,
    block_size: Optional[int] = None,
    disable: tuple[str, ...] = (),
) -> Path:
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


def modelopt_unified_export(
    mtq, export_hf_checkpoint, hf_dir: Path, cfg: dict, tokens: torch.Tensor, out: Path
) -> Path:
    """ModelOpt's own unified HF export of ``hf_dir`` (bf16), quantized with ``cfg`` by ``mtq.quantize`` on the
    same calibration batches (of 8) our pipeline saw: the oracle of the unified-export layout tests."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()

    def loop(m):
        with torch.no_grad():
            for b in tokens.split(8):
                m(b)

    mtq.quantize(model, cfg, loop)
    export_hf_checkpoint(model, export_dir=out, dtype=torch.bfloat16)
    return out


def safetensors_of(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a one-file export (``model.safetensors``)."""
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for byte-identical comparisons whatever its dtype."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_layout(ours: Path, theirs: Path, ignore: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """Our export and ModelOpt's hold the same files (``ignore``: files only ours writes, e.g. the tokenizer), the
    same tensor names, dtypes and shapes; returns both tensor dicts for the finer checks."""
    mine = {p.name for p in ours.iterdir()} - set(ignore) - {"generation_config.json"}
    assert mine == {p.name for p in theirs.iterdir()} - {"generation_config.json"}
    a, b = safetensors_of(ours), safetensors_of(theirs)
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
    return a, b


def synthetic_moe_case(root: Path) -> tuple[Path, Path, torch.Tensor]:
    """The synthetic Qwen3-MoE the MoE quantization tests share (seed 2): its HF directory, its bf16 TRT-LLM
    checkpoint and 8 x 32 calibration tokens (seed 9)."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic

    hf = make_synthetic("qwen3_moe", root / "hf", seed=2)
    base = convert(hf, root / "base", tp=1, dtype="bfloat16")
    return hf, base, torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(9))


def modelopt_config(mtq, names, int4_group: Optional[int] = None) -> dict:
    """ModelOpt's named configs merged in order (e.g. an algorithm and ``FP8_KV_CFG``), with INT4 weight groups of
    ``int4_group`` where given (ModelOpt's defaults are 128)."""
    cfgs = [copy.deepcopy(getattr(mtq, n)) for n in names]
    cfg = cfgs[0]
    for extra in cfgs[1:]:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(extra["quant_cfg"])
    for entry in cfg["quant_cfg"] if int4_group else ():
        c = entry.get("cfg")
        for cc in c if isinstance(c, list) else [c]:
            if isinstance(cc, dict) and "block_sizes" in cc:
                cc["block_sizes"] = {-1: int4_group, "type": "static"}
    return cfg
