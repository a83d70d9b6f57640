"""Shared pieces of the pre-quantized-source tests: converting a source for the engine target, each model's
dequantized linear weights by TensorRT-LLM name, and the logit comparison against a float64 reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.checkpoint.convert import convert
from trtpipe.errors import CheckpointError
from trtpipe.checkpoint.hf_names import HFNames
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.trtllm import ImportedLinears
from trtpipe.quant.writer import unsplit

IDS = torch.tensor([[1, 50, 100, 200, 300, 20, 7, 411, 3, 90]])
LINEAR_ATTRS = (("attention", "qkv"), ("attention", "dense"), ("mlp", "fc"), ("mlp", "gate"), ("mlp", "proj"))
FUSED = ("attention.qkv", "mlp.fc", "mlp.gate")


def convert_source(
    src: Path,
    out: Path,
    tp: int = 1,
    pp: int = 1,
    allow_lossy: tuple[str, ...] = (),
    moe_ep: int = -1,
    moe_tp: int = -1,
) -> Path:
    """The engine conversion of ``src``, accepting the lossy steps listed (``model.allow_lossy_import``)."""
    fmt = detect(src)
    return convert(
        src,
        out,
        tp=tp,
        pp=pp,
        moe_ep=moe_ep,
        moe_tp=moe_tp,
        overwrite=True,
        importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), allow_lossy),
    )


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


def by_hf_name(weights: dict[str, torch.Tensor], d: Path, layers: int) -> dict[str, tuple[str, torch.Tensor]]:
    """linear_weights() split back into HF projections: HF weight name -> (fused TRT-LLM linear, weight, the
    fused weight's largest magnitude)."""
    names = HFNames(d)
    out = {}
    for i in range(layers):
        for owner, attr in LINEAR_ATTRS:
            parts = names.layer[f"{owner}.{attr}.weight"]
            fused = weights[f"{i}.{owner}.{attr}"]
            for (h, _), w in zip(parts, fused.split([n for _, n in parts])):
                out[names.prefix.format(i) + h] = (f"{owner}.{attr}", w, float(fused.abs().max()))
    return out


def check_weights(got: dict, oracle: dict, what: str, quant_algo: str, engine: bool) -> None:
    """Every oracle weight equals ``got``'s exactly (FP8 members fused for the engine: within one FP8 rounding of
    the shared scale; W4A8: the fp16 rounding of weight_scale / weight_scale_2 the loader does)."""
    for name, want in oracle.items():
        linear, w, fused_max = got[name]
        want = want.float()
        if quant_algo == "FP8" and engine and linear in FUSED:
            s = fused_max / 448  # the shared scale: the member with the largest amax keeps a code of +-448
            assert bool(((w - want).abs() <= 2.0**-4 * w.abs().maximum(want.abs()) + 2.0**-10 * s).all()), name
        elif quant_algo == "W4A8_AWQ":  # the runtime rounds weight_scale / weight_scale_2 to fp16 as the loader does
            assert bool(((w - want).abs() <= 2.0**-11 * want.abs()).all()), f"{what}: {name}"
        else:
            assert torch.equal(w, want), f"{what}: {name}"


def edited_copy(src: Path, dst: Path, edit_tensors=None, edit_hq=None, edit_cfg=None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors / hf_quant_config.json / config.json edited in place
    by the given functions (a bad checkpoint made from a good one)."""
    shutil.copytree(src, dst)
    if edit_tensors:
        t = load_file(str(dst / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    for name, edit in (("hf_quant_config.json", edit_hq), ("config.json", edit_cfg)):
        if edit:
            cfg = json.loads((dst / name).read_text())
            edit(cfg)
            (dst / name).write_text(json.dumps(cfg))
    return dst


def conversion_refused(src: Path, out: Path, *needles: str, tp: int = 2) -> str:
    """The engine conversion of ``src`` refuses in one line holding every needle and writes nothing (no output, no
    temporary directory); returns the line."""
    with pytest.raises(CheckpointError) as exc:
        convert_source(src, out, tp=tp)
    msg = str(exc.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    assert not out.exists() and not any(out.parent.glob(f".{out.name}.tmp-*"))
    return msg
