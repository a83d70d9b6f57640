"""Zero-point INT4 made by the real producers (GPTQModel's AutoAWQ GEMM and asymmetric GPTQ v1, llm-compressor's
W4A16_ASYM) converted for the engine target as W4A16_AWQ with ``has_zero_point``: the checkpoint's codes are the
source's (unpacked here independently, from each format's definition), its scales the source's widened to float32,
its ``zero`` is ``-(z - 8) * s`` rounded once to the model dtype (TensorRT-LLM keeps it in that dtype), sharded at
tp 1 and 2; read back by the reference runtime it dequantizes to the producer library's own dequantization
(``oracle.safetensors``) within that one rounding of ``zero`` (none where the model dtype is float32), and its
logits equal the source's dequantized model to float32 summation order. fbgemm FP8 (no CPU producer: transformers
needs compute capability 9.0 for it) is the llm-compressor FP8_DYNAMIC fixture under fbgemm's config and names:
per-channel weights with per-token activations, the same numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import convert_source, linear_weights
from numerics import float64_copy
from prequantized import info, prequantized
from imported_helpers import by_hf_name
from trtpipe.checkpoint.convert import convert
from trtpipe.formats.primitives import unpack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.lossy import ZERO_POINT_ROUNDING
from trtpipe.quant.imported.trtllm import ImportedLinears
from trtpipe.runtime import load_checkpoint

pytestmark = pytest.mark.slow
ZERO_POINT = ("gptqmodel-awq_gemm-qwen3", "gptqmodel-gptq_v1_asym-qwen3", "llmc-w4a16_asym-stories")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble slot i of an AutoAWQ GEMM word holds output 8c + AWQ_ORDER[i]


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int64 [R, C, 8], nibble j = bits 4j..4j+3 (unsigned)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * j)) & 0xF for j in range(8)], -1)


def source_codes(t: dict, module: str, family: str, v1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned codes [out, in], true zero points [out, in/g], scales [out, in/g]) of one source projection, from
    the format's definition (not trtpipe's unpackers)."""
    if family == "awq":  # qweight [in, out/8], qzeros [in/g, out/8], both along the outputs with AWQ_ORDER

        def along_out(words):
            n = _nibbles(words)
            out = torch.empty_like(n)
            out[..., list(AWQ_ORDER)] = n
            return out.reshape(words.shape[0], -1)

        return along_out(t[module + ".qweight"]).t(), along_out(t[module + ".qzeros"]).t(), t[module + ".scales"].t()
    if family == "gptq":  # qweight [in/8, out] along the inputs; qzeros [in/g, out/8] (v1: words - 0x11111111)
        qw = _nibbles(t[module + ".qweight"]).permute(0, 2, 1).reshape(-1, t[module + ".qweight"].shape[1])
        zw = t[module + ".qzeros"].to(torch.int64) + (0x11111111 if v1 else 0)
        return qw.t(), _nibbles(zw).reshape(zw.shape[0], -1).t(), t[module + ".scales"].t()
    # compressed-tensors: signed codes + 8 packed 8 per int32 along the inputs; zero points along the outputs
    q = _nibbles(t[module + ".weight_packed"]).reshape(t[module + ".weight_packed"].shape[0], -1)
    zp = _nibbles(t[module + ".weight_zero_point"].t().contiguous()).reshape(
        t[module + ".weight_zero_point"].shape[1], -1
    )
    out_f = q.shape[0]
    return q[:, : int(t[module + ".weight_shape"][1])], zp[:, :out_f].t(), t[module + ".weight_scale"]


def _tensors(d: Path) -> dict:
    t = {}
    for f in sorted(d.glob("*.safetensors")):
        if f.name.startswith("oracle"):
            continue
        t.update(load_file(str(f)))
    return t


def _model_dtype(ckpt: Path) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
        json.loads((ckpt / "config.json").read_text())["dtype"]
    ]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ZERO_POINT)
def test_zero_point_int4_converts_exactly_to_w4a16_awq_with_zeros(name, tp, tmp_path):
    fixture = prequantized(name)
    fmt = detect(fixture)
    assert (fmt.quant_algo, fmt.engine.kind, fmt.llmapi.kind) == ("W4A16_AWQ", "converted", "refused")
    ckpt = convert_source(fixture, tmp_path / "ckpt", tp=tp, allow_lossy=(ZERO_POINT_ROUNDING,))
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (q["quant_algo"], q["has_zero_point"], q["pre_quant_scale"], q["group_size"]) == (
        "W4A16_AWQ",
        True,
        True,
        fmt.group_size,
    )
    dtype = _model_dtype(ckpt)
    src = _tensors(fixture)
    rank0 = load_file(str(ckpt / "rank0.safetensors"))
    # the re-layout, byte for byte at tp 1: up_proj is one source projection -> mlp.gate (stories' o_proj is left
    # float by the producer fixtures: at tp 2 it would hold half a group of 64)
    if tp == 1:
        module = "model.layers.0.mlp.up_proj"
        codes, zeros, scales = source_codes(src, module, fmt.family, fmt.params.get("v1", False))
        lin = "transformer.layers.0.mlp.gate."
        assert torch.equal(unpack_int4_rows(rank0[lin + "weight"]).long() + 8, codes)
        assert torch.equal(rank0[lin + "weights_scaling_factor"], scales.float())
        want_zero = (-(zeros - 8).double() * scales.double()).to(dtype).t()
        assert rank0[lin + "zero"].dtype == dtype and torch.equal(rank0[lin + "zero"], want_zero)
        assert torch.equal(
            rank0[lin + "prequant_scaling_factor"], torch.ones_like(rank0[lin + "prequant_scaling_factor"])
        )
    # read back: the producer's own dequantization, within one model-dtype rounding of zero = -(z - 8) s
    oracle = load_file(str(fixture / "oracle.safetensors"))
    layers = json.loads((fixture / "config.json").read_text())["num_hidden_layers"]
    model = load_checkpoint(ckpt)
    got = by_hf_name(linear_weights(model), fixture, layers)
    eps = torch.finfo(dtype).eps / 2  # unit roundoff of the model dtype
    worst = 0.0
    for hf_name, want in oracle.items():
        module = hf_name[: -len(".weight")]
        _, w, _ = got[hf_name]
        codes, zeros, scales = source_codes(src, module, fmt.family, fmt.params.get("v1", False))
        g = codes.shape[1] // scales.shape[1]
        zero_mag = ((zeros - 8).double() * scales.double()).abs().repeat_interleave(g, dim=1)
        err = (w.double() - want.double()).abs()
        assert bool((err <= eps * zero_mag).all()), (hf_name, float(err.max()))
        worst = max(worst, float((err / want.double().abs().clamp_min(1e-30)).max()))
    assert worst > 0.0 or dtype == torch.float32  # a bf16 / fp16 zero really is rounded (the bound is not vacuous)


@pytest.mark.parametrize("name", ZERO_POINT)
def test_zero_point_int4_in_a_float32_checkpoint_is_exact_to_the_logits(name, tmp_path):
    """With a float32 model dtype ``zero`` holds ``-(z - 8) s`` exactly: the weights are the producer's, and the
    logits (float64 reference runtime) equal transformers' float64 logits of the source where it loads on CPU."""
    fixture = prequantized(name)
    fmt = detect(fixture)
    ckpt = convert(
        fixture,
        tmp_path / "ckpt",
        tp=2,
        dtype="float32",
        importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(fixture)),
    )
    oracle = load_file(str(fixture / "oracle.safetensors"))
    layers = json.loads((fixture / "config.json").read_text())["num_hidden_layers"]
    model = load_checkpoint(ckpt)
    got = by_hf_name(linear_weights(model), fixture, layers)
    for hf_name, want in oracle.items():
        assert torch.equal(got[hf_name][1], want.float()), hf_name
    logits = fixture / "oracle_logits.safetensors"
    if logits.exists() and info(name)["producer"] != "gptqmodel":  # GPTQModel's logits are fp16 kernels' (no reference)
        ref = load_file(str(logits))
        with torch.no_grad():
            ours = float64_copy(model).forward(ref["input_ids"].reshape(1, -1))
        theirs = ref["logits"].double().reshape(ours.shape)
        # the same bound as test_producer_fixtures.py: both float64 on the same weights
        assert float((ours - theirs).abs().max()) <= 2.0**-24 * float(theirs.abs().max()) * 64


def _fbgemm_from_fp8_dynamic(tmp_path: Path) -> Path:
    """llm-compressor's FP8_DYNAMIC checkpoint written under fbgemm FP8's config and dtypes (weight_scale float32
    [out, 1], widened exactly from the model dtype): per-channel FP8 weights, per-token dynamic activations."""
    src = prequantized("llmc-fp8_dynamic-stories")
    out = tmp_path / "fbgemm"
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("oracle_logits.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    ignore = cfg["quantization_config"].get("ignore") or []
    cfg["quantization_config"] = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ignore,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    for f in out.glob("model*.safetensors"):
        t = load_file(str(f))
        save_file({k: v.float() if k.endswith(".weight_scale") else v for k, v in t.items()}, str(f))
    return out


def test_fbgemm_fp8_converts_to_fp8_rowwise_with_its_clamp(tmp_path):
    src = _fbgemm_from_fp8_dynamic(tmp_path)
    fmt = detect(src)
    assert (fmt.family, fmt.quant_algo, fmt.engine.kind) == ("fbgemm_fp8", "FP8_PER_CHANNEL_PER_TOKEN", "converted")
    ckpt = convert_source(src, tmp_path / "ckpt", tp=2)
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN" and q["clamp_val"] == [-1200.0, 1200.0]
    oracle = load_file(str(src / "oracle.safetensors"))
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    got = by_hf_name(linear_weights(load_checkpoint(ckpt)), src, layers)
    for hf_name, want in oracle.items():
        assert torch.equal(got[hf_name][1], want.float()), hf_name


def test_awq_projection_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    src = tmp_path / "awq"
    shutil.copytree(prequantized("gptqmodel-awq_gemm-qwen3"), src)
    f = next(
        p for p in sorted(src.glob("model*.safetensors")) if any(k.endswith("o_proj.qzeros") for k in load_file(str(p)))
    )
    t = load_file(str(f))
    name = next(k for k in t if k.endswith("layers.0.self_attn.o_proj.qzeros"))
    t[name] = t[name][:-1].contiguous()
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is torch.int32 \["):
        convert_source(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
