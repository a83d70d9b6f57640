"""GPTQ (v1 and v2 zero points, symmetric 4-bit, contiguous g_idx) re-laid out exactly as W4A16 AWQ with unit
pre-quant scales, for both targets; act-order with a non-contiguous g_idx and asymmetric zeros are refused naming
the tensor. The checkpoints here are packed by the format's definition from trtpipe's symmetric int4 export, so
each case (v1 / v2 zero points, act-order orders) is built on purpose, and the oracle is the format's own
dequantization formula, written out below from the GPTQModel source. GPTQModel itself (7.6; 7.7 needs torch >=
2.14.1) runs in the producers' venv and makes the dense Qwen3 GPTQ fixtures of tests/prequantized.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import convert_source, linear_weights
from trtpipe.formats.primitives import unpack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.export.imported import write_llmapi
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

G = 64  # the unified int4 exports' group size (tests/quant/imported/conftest.py GROUP)
HF_LINEARS = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj",),
    "mlp.gate": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}


def _pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit codes -> int32 words of 8, LSB first, along ``dim`` (GPTQModel ``pack_original``)."""
    c = codes.to(torch.int64)
    c = c.unflatten(dim, (c.shape[dim] // 8, 8))
    words = sum(c.select(dim + 1, j) << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _oracle(qweight, qzeros, scales, g_idx, v1: bool) -> torch.Tensor:
    """GPTQ dequantization: W[o, i] = s[g_idx[i], o] * (q[i, o] - z[g_idx[i], o]), z = stored + 1 for v1."""
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], 1).reshape(-1, w.shape[1])  # [in, out]
    z = qzeros.to(torch.int64) & 0xFFFFFFFF
    z = torch.stack([(z >> (4 * j)) & 0xF for j in range(8)], -1).reshape(z.shape[0], -1) + (1 if v1 else 0)
    gi = g_idx.long()
    return (scales.float()[gi] * (q - z[gi]).float()).t()  # [out, in]


def make_gptq(unified_int4: Path, out: Path, v1: bool, g_idx=None, zero_delta=0, group: int = G) -> Path:
    """The symmetric int4 export repacked as a GPTQ checkpoint (fp16 scales; an all-zero bias on every quantized
    Linear, as some exporters write). ``group`` < G splits each group of G into G / group with the same scale (the
    same weights: what an act-order checkpoint needs, more than one group per row)."""
    shutil.copytree(unified_int4, out)
    (out / "hf_quant_config.json").unlink()
    t = load_file(str(out / "model.safetensors"))
    for name in [k for k in t if k.endswith(".weight_scale")]:
        m = name[: -len(".weight_scale")]
        q = unpack_int4_rows(t.pop(m + ".weight").view(torch.int8)).to(torch.int16) + 8  # [out, in] unsigned
        s = t.pop(name).half().repeat_interleave(G // group, dim=1)  # [out, in/group]
        out_f, in_f = q.shape
        if out_f % 8:  # GPTQ packs zero points 8 per word along the outputs: gate/up (172) stay bf16 here
            t[m + ".weight"] = ((q - 8).float() * s.float().repeat_interleave(group, dim=1)).bfloat16()
            continue
        t[m + ".qweight"] = _pack(q.t(), 0)  # [in/8, out]
        z = torch.full((in_f // group, out_f), 8 - (1 if v1 else 0), dtype=torch.int16)
        z[0, 0] += zero_delta
        t[m + ".qzeros"] = _pack(z, 1)  # [in/g, out/8]
        t[m + ".scales"] = s.t().contiguous()
        t[m + ".g_idx"] = (torch.arange(in_f) // group if g_idx is None else g_idx(in_f)).to(torch.int32)
        t[m + ".bias"] = torch.zeros(out_f, dtype=torch.float16)
        t.pop(m + ".pre_quant_scale", None)
    save_file(t, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": g_idx is not None,
        "sym": True,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
        "modules_to_not_convert": ["mlp", "self_attn.o_proj", "lm_head"],
    }
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _oracle_weights(src: Path, v1: bool) -> dict[str, torch.Tensor]:
    t = load_file(str(src / "model.safetensors"))
    out = {}
    for i in range(5):
        for trt, hfs in HF_LINEARS.items():
            ws = []
            for h in hfs:
                m = f"model.layers.{i}.{h}"
                ws.append(
                    _oracle(t[m + ".qweight"], t[m + ".qzeros"], t[m + ".scales"], t[m + ".g_idx"], v1)
                    if m + ".qweight" in t
                    else t[m + ".weight"].float()
                )
            out[f"{i}.{trt}"] = torch.cat(ws)
    return out


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
def test_symmetric_gptq_is_relaid_out_exactly_for_both_targets(unified, tmp_path, v1):
    src = make_gptq(unified("int4_wo"), tmp_path / "gptq", v1)
    fmt = detect(src)
    assert (fmt.family, fmt.quant_algo, fmt.engine.kind, fmt.llmapi.kind) == (
        "gptq",
        "W4A16_AWQ",
        "converted",
        "re-laid out",
    )
    oracle = _oracle_weights(src, v1)
    conv = load_checkpoint(convert_source(src, tmp_path / "ckpt", tp=2))
    for name, w in linear_weights(conv).items():
        assert torch.equal(w, oracle[name]), f"engine: {name}"
    hf = tmp_path / "hf"
    hf.mkdir()
    write_llmapi(fmt, src, hf)
    relaid = load_hf_checkpoint(hf)
    for name, w in linear_weights(relaid).items():
        assert torch.equal(w, oracle[name]), f"llmapi: {name}"
    q = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert (
        q["quant_algo"] == "W4A16_AWQ" and q["group_size"] == G and "model.layers.0.mlp.up_proj" in q["exclude_modules"]
    )


def test_act_order_with_scattered_groups_is_refused(unified, tmp_path):
    src = make_gptq(
        unified("int4_wo"), tmp_path / "gptq", True, g_idx=lambda n: torch.arange(n).flip(0) // (G // 2), group=G // 2
    )  # two groups a row, in reverse order
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.self_attn.q_proj.g_idx' is not contiguous"):
        convert_source(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_act_order_with_contiguous_groups_is_accepted(unified, tmp_path):
    src = make_gptq(unified("int4_wo"), tmp_path / "gptq", True, g_idx=lambda n: torch.arange(n) // G)
    assert (
        json.loads((convert_source(src, tmp_path / "ckpt") / "config.json").read_text())["quantization"]["quant_algo"]
        == "W4A16_AWQ"
    )


def test_asymmetric_zero_point_is_refused_naming_the_tensor(unified, tmp_path):
    src = make_gptq(unified("int4_wo"), tmp_path / "gptq", False, zero_delta=1)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.q_proj.qzeros' holds zero point 9"):
        convert_source(src, tmp_path / "ckpt")
