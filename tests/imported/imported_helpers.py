"""Shared pieces of the pre-quantized-source tests: converting a source for the engine target, each model's
dequantized linear weights by TensorRT-LLM name, and the logit comparison against a float64 reference."""

from __future__ import annotations

from pathlib import Path

import torch

from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.checkpoint.convert import convert
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.trtllm import ImportedLinears
from trtpipe.quant.writer import unsplit

IDS = torch.tensor([[1, 50, 100, 200, 300, 20, 7, 411, 3, 90]])
LINEAR_ATTRS = (("attention", "qkv"), ("attention", "dense"), ("mlp", "fc"), ("mlp", "gate"), ("mlp", "proj"))


def convert_source(src: Path, out: Path, tp: int = 1, pp: int = 1) -> Path:
    fmt = detect(src)
    return convert(src, out, tp=tp, pp=pp, overwrite=True,
                   importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src)))


def linear_weights(model) -> dict[str, torch.Tensor]:
    """'{layer}.{owner}.{attr}' -> the float32 [out, in] weight it multiplies by (tp shards un-split as the
    quantizer un-splits a checkpoint: KV-head replicas dropped)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for owner, attr in LINEAR_ATTRS:
            shards = [getattr(s, attr) for s in getattr(layer, owner)]
            ws = [torch.cat([p.weight for p in m.parts]) if hasattr(m, "parts") else m.weight for m in shards]
            out[f"{i}.{owner}.{attr}"] = unsplit(f"{owner}.{attr}.weight", ws, model.args)
    return out


def assert_logits_match(model, reference, what: str) -> None:
    """``model``'s logits equal ``reference``'s to float32 summation order (float64 reference, numerics rule)."""
    with torch.no_grad():
        ref32 = reference.forward(IDS)
        ref64 = float64_copy(reference).forward(IDS)
        got = model.forward(IDS)
    assert_as_accurate(got, ref64, error_scale(ref32, ref64), what)
