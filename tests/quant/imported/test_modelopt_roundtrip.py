"""trtpipe's own unified HF exports (ModelOpt's format) used as pre-quantized sources of the engine target.

The converter never dequantizes: codes and scales are copied (FP8 fused members requantized to the shared scale,
the one rounding ModelOpt's TensorRT-LLM export also makes), so the converted checkpoint's dequantized weights equal
the source's bit for bit, and its logits equal the source's (the reference runtime loading the unified directory)
to float32 summation order, at tp 1 and tp 2 x pp 2.
"""

from __future__ import annotations

import json

import pytest
import torch

from imported_helpers import assert_logits_match, convert_source, linear_weights
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.lossy import FP8_REQUANTIZE
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

EXACT = ("none", "fp8_pc_pt", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq", "nvfp4")
QUANT_ALGO = {
    "none": None,
    "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16_AWQ",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
    "nvfp4": "NVFP4",
    "fp8": "FP8",
}


@pytest.mark.parametrize("algo", EXACT)
def test_exact_formats_convert_bit_for_bit(unified, tmp_path, algo):
    src = unified(algo)
    hf = load_hf_checkpoint(src)
    ckpt = convert_source(src, tmp_path / "tp1")
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == QUANT_ALGO[algo]
    assert q["kv_cache_quant_algo"] == ("FP8" if algo == "none" else None)
    ours, theirs = linear_weights(load_checkpoint(ckpt)), linear_weights(hf)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), f"{algo}: {name} dequantizes differently"
    if (q["quant_algo"] or "").startswith(
        "W4"
    ):  # mlp.proj (in 172) is excluded by the export: so in the checkpoint too
        assert "transformer.layers.0.mlp.proj" in q["exclude_modules"] and q["group_size"] == 64
    assert_logits_match(load_checkpoint(ckpt), hf, f"{algo} tp1")
    sharded = load_checkpoint(convert_source(src, tmp_path / "tp2pp2", tp=2, pp=2))
    for name, w in linear_weights(sharded).items():
        assert torch.equal(w, theirs[name]), f"{algo} tp2 pp2: {name} shards do not concatenate to the source"
    if algo != "fp8_pc_pt":  # per-token scales are per rank's input slice in a row-parallel linear: tp changes them
        assert_logits_match(sharded, hf, f"{algo} tp2 pp2")


def test_fp8_fused_members_are_requantized_once_to_the_shared_scale(unified, tmp_path):
    """Per-projection FP8 weight scales become the fused linear's max: members already at the max keep their codes,
    the others move by at most one FP8 rounding (half a step of e4m3, 2^-4 relative, or half the smallest
    subnormal step 2^-9 x scale); with those weights put back into the source model the logits are the same."""
    src = unified("fp8")
    assert detect(src).kv_cache == "FP8"
    hf = load_hf_checkpoint(src)
    ckpt = convert_source(src, tmp_path / "tp1", allow_lossy=(FP8_REQUANTIZE,))
    cfg = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (cfg["quant_algo"], cfg["kv_cache_quant_algo"]) == ("FP8", "FP8")
    conv = load_checkpoint(ckpt)
    ours, theirs = linear_weights(conv), linear_weights(hf)
    moved = 0
    for name in ours:
        a, b = ours[name], theirs[name]
        s = float(a.abs().max()) / 448  # the fused scale: the member with the largest amax keeps a code of +-448
        bound = 2.0**-4 * torch.maximum(a.abs(), b.abs()) + 2.0**-10 * s
        assert bool(((a - b).abs() <= bound).all()), f"{name}: moved by more than one FP8 rounding"
        moved += int((a != b).sum())
    assert moved > 0  # q/k/v scales differ on this model: the requantization did happen
    # the same model with the converted weights: same logits (the rest of the conversion is exact)
    for i, layer in enumerate(hf.layers):
        for owner, attr in (("attention", "qkv"), ("mlp", "fc"), ("mlp", "gate")):
            m = getattr(getattr(layer, owner)[0], attr)
            w = ours[f"{i}.{owner}.{attr}"]
            parts = m.parts if hasattr(m, "parts") else [m]
            for p, piece in zip(parts, w.split([p.weight.shape[0] for p in parts])):
                p.weight.data.copy_(piece)
    assert_logits_match(
        load_checkpoint(convert_source(src, tmp_path / "tp2", tp=2, allow_lossy=(FP8_REQUANTIZE,))), hf, "fp8 tp2"
    )
