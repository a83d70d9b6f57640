"""The pre-quantized fixtures (tests/prequantized.py, made by the real producers) are self-consistent: the
quantization config names the tensors present, every Linear is either quantized or excluded by the config,
the oracle holds exactly the quantized weights at their HF shapes, and for weight-only formats transformers'
logits are the dense forward of the oracle's weights (both float64: equal to float64 round-off)."""

from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prequantized import names, prequantized

pytestmark = pytest.mark.slow

# fixture format -> (ModelOpt quant_algo, kv_cache_quant_algo)
MODELOPT_ALGO = {
    "fp8": ("FP8", None),
    "fp8_pcpt": ("FP8_PER_CHANNEL_PER_TOKEN", None),
    "fp8_kv": ("FP8", "FP8"),
    "w4a16_awq": ("W4A16_AWQ", None),
    "w4a8_awq": ("W4A8_AWQ", None),
    "nvfp4": ("NVFP4", None),
}
# ModelOpt quant_algo -> per-module tensors besides the weight (AWQ's pre_quant_scale: checked separately)
MODELOPT_TENSORS = {
    "FP8": {"weight_scale", "input_scale"},
    "FP8_PER_CHANNEL_PER_TOKEN": {"weight_scale"},
    "W4A16_AWQ": {"weight_scale"},
    "W4A8_AWQ": {"weight_scale", "weight_scale_2", "input_scale"},
    "NVFP4": {"weight_scale", "weight_scale_2", "input_scale"},
}
# compressed-tensors format -> the dtype of ``weight`` (None: packed into weight_packed)
CT_WEIGHT_DTYPE = {"float-quantized": torch.float8_e4m3fn, "int-quantized": torch.int8, "pack-quantized": None}
# relative Frobenius error of the oracle against the unquantized weight that each format's rounding stays under
# (8-bit: ~2^-4 per element at worst; 4-bit: half a step of 1/7 of a group's range); ModelOpt's AWQ weights are
# rescaled by the searched pre-quant scales, so they are not compared with the original
REL_ERR = {8: 0.08, 4: 0.3}
FIXTURES = names()


def _checkpoint(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        if not f.name.startswith("oracle"):
            out.update(load_file(str(f)))
    return out


def _base_dir(d: Path, info: dict) -> Path:
    return (
        (Path(__file__).resolve().parents[2] / info["base"])
        if info["base"].startswith("models/")
        else d.parent / info["base"]
    )


def _linears(base: Path) -> dict[str, tuple[int, ...]]:
    """HF Linear module -> weight shape, from the unquantized base checkpoint (2-D weights but embeddings)."""
    t = _checkpoint(base)
    return {
        k[: -len(".weight")]: tuple(v.shape)
        for k, v in t.items()
        if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k
    }


def _quantized_modules(t: dict[str, torch.Tensor]) -> set[str]:
    return {k.rsplit(".", 1)[0] for k in t if k.endswith((".weight_scale", ".weight_packed", ".qweight"))}


def _excluded(info: dict, d: Path, module: str) -> bool:
    if info["producer"] == "modelopt":
        pats = json.loads((d / "hf_quant_config.json").read_text())["quantization"].get("exclude_modules") or []
        return any(fnmatch(module, p) for p in pats)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    for entry in qc.get("ignore") or qc.get("modules_to_not_convert") or []:
        if (
            entry.startswith("re:")
            and re.match(entry[3:], module)
            or entry == module
            or module.endswith("." + entry)
            or module == entry
        ):
            return True
    return False


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    d = prequantized(request.param)
    info = json.loads((d / "producer.json").read_text())
    return request.param, d, info


def test_files_and_producer_json(fixture):
    name, d, info = fixture
    for f in ("config.json", "oracle.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f"{name}: {f} missing"
    assert _checkpoint(d), f"{name}: no checkpoint safetensors"
    assert info["name"] == name and info["producer"] in ("modelopt", "llmcompressor", "gptqmodel")
    assert info["versions"]["torch"].startswith("2.13.0") and info["call"] and info["oracle"]
    assert (info["oracle_logits"] is None) == (not (d / "oracle_logits.safetensors").exists()), name
    assert info["oracle_logits"] or info["oracle_logits_absent"], name
    assert not list(d.parent.glob(f"{name}.tmp")), f"{name}: half-written fixture left"


def test_config_names_the_tensors_present(fixture):
    name, d, info = fixture
    t = _checkpoint(d)
    base = _linears(_base_dir(d, info))
    quantized = _quantized_modules(t)
    assert quantized, name
    for m in base:
        assert (m in quantized) != _excluded(info, d, m), (
            f"{name}: {m} quantized={m in quantized} but excluded={_excluded(info, d, m)}"
        )
        if m not in quantized:
            assert t[f"{m}.weight"].dtype in (torch.bfloat16, torch.float16, torch.float32), f"{name}: {m}"
    if info["producer"] == "modelopt":
        hq = json.loads((d / "hf_quant_config.json").read_text())
        assert hq["producer"]["name"] == "modelopt"
        algo, kv = MODELOPT_ALGO[info["format"]]
        assert (hq["quantization"]["quant_algo"], hq["quantization"]["kv_cache_quant_algo"]) == (algo, kv), name
        for m in quantized:
            have = {k[len(m) + 1 :] for k in t if k.startswith(m + ".")}
            assert MODELOPT_TENSORS[algo] | {"weight"} <= have, f"{name}: {m} has {sorted(have)}"
            if algo.endswith("AWQ") and m.endswith(("o_proj", "down_proj")):
                assert "pre_quant_scale" in have, f"{name}: {m}"
        if kv:
            for m in quantized:
                if m.endswith(("k_proj", "v_proj")):
                    assert f"{m}.{m[-6]}_scale" in t, f"{name}: {m} has no KV scale"
    elif info["producer"] == "llmcompressor":
        qc = json.loads((d / "config.json").read_text())["quantization_config"]
        assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
        (group,) = qc["config_groups"].values()
        wdtype = CT_WEIGHT_DTYPE[group["format"]]
        w, a = group["weights"], group.get("input_activations")
        for m in quantized:
            if wdtype is None:
                assert t[f"{m}.weight_packed"].dtype == torch.int32 and f"{m}.weight_shape" in t, f"{name}: {m}"
                assert tuple(t[f"{m}.weight_shape"].tolist()) == base[m], f"{name}: {m}"
            else:
                assert t[f"{m}.weight"].dtype == wdtype, f"{name}: {m}"
            assert (f"{m}.weight_zero_point" in t) == (not w["symmetric"]), f"{name}: {m}"
            assert (f"{m}.input_scale" in t) == bool(a and not a["dynamic"]), f"{name}: {m}"
            if w["strategy"] == "group":
                assert t[f"{m}.weight_scale"].shape == (base[m][0], -(-base[m][1] // w["group_size"])), name
    if info["producer"] == "gptqmodel":
        qc = json.loads((d / "config.json").read_text())["quantization_config"]
        awq = info["format"].startswith("awq")
        assert qc["quant_method"] == ("awq" if awq else "gptq") and qc["bits"] == 4, name
        if awq:
            assert qc.get("version", qc.get("format")) == "gemm" and qc["zero_point"], name
        else:
            assert qc["checkpoint_format"] == ("gptq_v2" if "v2" in info["format"] else "gptq"), name
            assert qc["desc_act"] == ("actorder" in info["format"]) and qc["sym"] == ("asym" not in info["format"])
        g = qc["group_size"]
        for m in quantized:
            out_f, in_f = base[m]
            shapes = {
                "qweight": (in_f, out_f // 8) if awq else (in_f // 8, out_f),
                "qzeros": (in_f // g, out_f // 8),
                "scales": (in_f // g, out_f),
            }
            if not awq:
                shapes["g_idx"] = (in_f,)
            for k, shape in shapes.items():
                assert tuple(t[f"{m}.{k}"].shape) == shape, f"{name}: {m}.{k} {tuple(t[f'{m}.{k}'].shape)}"
            # GPTQ scales are fp16; GPTQModel writes AWQ scales in the model dtype (AutoAWQ: fp16)
            assert t[f"{m}.qweight"].dtype == torch.int32 and t[f"{m}.scales"].dtype in (torch.float16, torch.bfloat16)
    if info["producer"] == "llmcompressor":
        layers = {m.split(".self_attn")[0] for m in quantized if ".self_attn." in m}
        for layer in layers:
            for s in ("k_scale", "v_scale"):
                assert (f"{layer}.self_attn.{s}" in t) == bool(qc.get("kv_cache_scheme")), f"{name}: {layer} {s}"


def test_oracle_covers_every_quantized_weight(fixture):
    name, d, info = fixture
    t = _checkpoint(d)
    oracle = load_file(str(d / "oracle.safetensors"))
    base = _linears(_base_dir(d, info))
    assert set(oracle) == {f"{m}.weight" for m in _quantized_modules(t)}, name
    ref = _checkpoint(_base_dir(d, info))
    for k, v in oracle.items():
        m = k[: -len(".weight")]
        assert v.dtype == torch.float32 and tuple(v.shape) == base[m] and torch.isfinite(v).all(), f"{name}: {k}"
        if info["producer"] == "modelopt" and "awq" in info["format"]:
            continue
        bits = 4 if any(s in info["format"] for s in ("w4", "nvfp4", "gptq", "awq")) else 8
        w = ref[k].double()
        err = ((v.double() - w).norm() / w.norm()).item()
        assert 0 < err < REL_ERR[bits], f"{name}: {k} relative error {err:.3g}"


def test_weight_only_logits_are_the_oracle_weights_forward(fixture):
    """Where the format quantizes weights only, transformers' logits over the quantized checkpoint equal a dense
    float64 model holding the oracle's weights and the checkpoint's unquantized tensors."""
    name, d, info = fixture
    if not info["oracle_logits"]:
        pytest.skip(f"{name}: no transformers logits ({info['oracle_logits_absent']})")
    if info["producer"] != "llmcompressor":
        pytest.skip(f"{name}: {info['producer']}'s kernels dequantize in the scales' dtype, not exactly")
    if not info["activations_in_logits"].startswith("none"):
        pytest.skip(f"{name}: transformers' forward also quantizes activations ({info['activations_in_logits']})")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_base_dir(d, info), dtype=torch.float64).eval()
    sd = model.state_dict()
    t, oracle = _checkpoint(d), load_file(str(d / "oracle.safetensors"))
    for k, v in {**{k: v for k, v in t.items() if k in sd and v.is_floating_point()}, **oracle}.items():
        sd[k].copy_(v.double())
    ref = load_file(str(d / "oracle_logits.safetensors"))
    with torch.no_grad():
        got = model(ref["input_ids"][None]).logits[0]
    scale = ref["logits"].abs().max().item()
    torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-9 * scale)


@pytest.mark.parametrize("name", [n for n in FIXTURES if n.startswith("gptqmodel-gptq")])
def test_gptq_oracle_is_the_format_formula(name):
    """GPTQModel's dequantization (the oracle) equals GPTQ's definition read straight off the stored tensors:
    4-bit codes LSB-first along the input dim, zero points along the output dim, v1 storing z - 1,
    ``W^T[i, o] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])``; exactly, in float32."""
    d = prequantized(name)
    t, oracle = _checkpoint(d), load_file(str(d / "oracle.safetensors"))
    v1 = json.loads((d / "config.json").read_text())["quantization_config"]["checkpoint_format"] == "gptq"
    shifts = torch.arange(8, dtype=torch.int32) * 4
    for k in oracle:
        m = k[: -len(".weight")]
        qw, qz, g = t[f"{m}.qweight"], t[f"{m}.qzeros"], t[f"{m}.g_idx"].long()
        q = ((qw[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qw.shape[1])
        z = ((qz[:, :, None] >> shifts[None, None, :]) & 15).reshape(qz.shape[0], -1) + int(v1)
        w = (t[f"{m}.scales"].float()[g] * (q - z[g]).float()).T
        assert torch.equal(w, oracle[k]), f"{name}: {k} off by {(w - oracle[k]).abs().max().item():.3g}"
