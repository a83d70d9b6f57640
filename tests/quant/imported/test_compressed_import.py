"""compressed-tensors checkpoints (trtpipe's own export, loaded by transformers + compressed-tensors 0.20 as the
producer's dequantization) as pre-quantized sources: re-laid out into ModelOpt's unified format for the llmapi
target and converted for the engine target, each dequantized weight equal to what compressed-tensors makes of it."""

from __future__ import annotations

import json

import pytest
import torch

from imported_helpers import IDS, assert_logits_match, convert_source, linear_weights
from trtpipe.quant.imported.detect import detect
from trtpipe.export.imported import write_llmapi
from trtpipe.quant.imported.lossy import FP8_REQUANTIZE
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from optional import needs

pytestmark = needs("compressed_tensors")

CANON = {"fp8": "FP8", "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN", "int4_wo": "W4A16_AWQ"}
HF_LINEARS = {
    "attention.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.dense": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj",),
    "mlp.gate": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}


def _transformers_weights(src) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantization, by the TRT-LLM names of linear_weights()."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert model.hf_quantizer is not None
    mods = dict(model.named_modules())
    out = {}
    for i in range(model.config.num_hidden_layers):
        for trt, hfs in HF_LINEARS.items():
            ws = []
            for h in hfs:
                m = mods[f"model.layers.{i}.{h}"]
                if hasattr(m, "weight_packed"):  # still compressed on CPU: the library's own unpack + dequantize
                    q = unpack_from_int32(m.weight_packed, 4, torch.Size(m.weight_shape.tolist()))
                    w = dequantize(q, m.weight_scale, None, args=m.quantization_scheme.weights, dtype=torch.float32)
                elif m.weight.dtype == torch.float8_e4m3fn:
                    w = dequantize(
                        m.weight, m.weight_scale, None, args=m.quantization_scheme.weights, dtype=torch.float32
                    )
                else:
                    w = m.weight
                ws.append(w.detach().float())
            out[f"{i}.{trt}"] = torch.cat(ws)
    return out


@pytest.mark.parametrize("algo", list(CANON))
def test_relayout_and_conversion_dequantize_as_compressed_tensors_does(compressed, tmp_path, algo):
    src = compressed(algo)
    fmt = detect(src)
    assert (fmt.family, fmt.quant_algo) == ("compressed-tensors", CANON[algo])
    theirs = _transformers_weights(src)
    # llmapi: exact re-layout into ModelOpt's unified format
    out = tmp_path / "hf"
    out.mkdir()
    hq = write_llmapi(fmt, src, out)
    assert hq["quantization"]["quant_algo"] == CANON[algo] and (out / "hf_quant_config.json").exists()
    relaid = load_hf_checkpoint(out)
    for name, w in linear_weights(relaid).items():
        assert torch.equal(w, theirs[name]), f"llmapi {algo}: {name}"
    assert_logits_match(relaid, load_hf_checkpoint(src), f"{algo} re-laid out")
    if algo == "int4_wo":  # the PyTorch backend reads a pre_quant_scale on o_proj / down_proj (here: unit)
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert torch.equal(
                f.get_tensor("model.layers.0.self_attn.o_proj.pre_quant_scale"), torch.ones(64, dtype=torch.bfloat16)
            )
            assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in f.keys()
    # engine: converted (FP8 fused members requantized to the shared scale: bound in test_modelopt_roundtrip)
    # int4 at tp 1: o_proj's 64 inputs are one group of 64, which a tp 2 rank could not hold half of
    conv = load_checkpoint(
        convert_source(src, tmp_path / "ckpt", tp=1 if algo == "int4_wo" else 2, allow_lossy=(FP8_REQUANTIZE,))
    )
    q = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == CANON[algo]
    for name, w in linear_weights(conv).items():
        if algo == "fp8" and name.split(".", 1)[1] in ("attention.qkv", "mlp.fc", "mlp.gate"):
            s = float(w.abs().max()) / 448
            assert bool(
                ((w - theirs[name]).abs() <= 2.0**-4 * w.abs().maximum(theirs[name].abs()) + 2.0**-10 * s).all()
            ), name
        else:
            assert torch.equal(w, theirs[name]), f"engine {algo}: {name}"
    with torch.no_grad():
        assert torch.isfinite(conv.forward(IDS)).all()
