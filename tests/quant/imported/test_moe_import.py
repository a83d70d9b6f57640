"""NVIDIA ModelOpt 0.47's own FP8 exports (per tensor, FP8 KV cache) of a synthetic Qwen3-MoE and Mixtral as
pre-quantized sources of the engine target.

Experts are stacked as trtpipe's own FP8 MoE checkpoint and TensorRT-LLM 1.2's MoE layer lay them out: ``mlp.fc``
[E, 2I, H] (each expert's up rows, then its gate rows), ``mlp.proj`` [E, H, I], one weight scale per expert
``[E, 1]`` (an expert's up and gate share the max: ModelOpt's export already makes them equal, so the codes are the
source's), one activation scale ``[1]`` per linear (the max over the experts). Where an expert's up and gate scales
differ (an edited source), the member with the smaller scale is requantized: within one FP8 rounding. A missing
expert scale is named before anything is written; int4 experts are refused with the reason.

Logits: a MoE routes discontinuously (top-k of the router's scores), so a weight moved by one FP8 rounding can send a
token to another expert and no bound on the logits follows from the weights' error. The converted checkpoint is
therefore compared with the source's reference model holding the converted weights of the requantized members only
(q/k/v, whose ModelOpt scales differ, and the edited expert's up/gate; every other expert weight is the source's as
stored), to float32 summation order against a float64 reference, at tp 1, moe_tp 2 and moe_ep 2: the rest of the
conversion (layout, stacking, tp / ep sharding, scales) is exact. The requantization itself is bounded weight by
weight.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from imported_helpers import convert_source
from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.formats.primitives import dequantize
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.trtllm import moe_refusal
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.app.validation import check_recipe, load_recipe
from optional import needs

pytestmark = [pytest.mark.oracle, needs("modelopt")]

LAYERS = 2
IDS = torch.tensor([[1, 50, 100, 200, 30, 20, 7, 41, 3, 90, 17, 249]])
# family -> (HF expert prefix, up, gate, down): the fc rule's order is up then gate
NAMES = {
    "qwen3_moe": ("model.layers.{}.mlp.experts.{}.", "up_proj", "gate_proj", "down_proj"),
    "mixtral": ("model.layers.{}.block_sparse_moe.experts.{}.", "w3", "w1", "w2"),
}
# the edited source: this expert's gate scale times 1.37 (its weights so scaled), so its up is requantized
EDITED = (1, 3, 1.37)


@pytest.fixture(scope="module", params=list(NAMES))
def source(request, tmp_path_factory):
    """ModelOpt's FP8 + FP8-KV export of a synthetic MoE (made by ModelOpt itself, once per family)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from quant_helpers import modelopt_config, modelopt_unified_export, synthetic_moe_case
    from trtpipe.models.synthetic import make_synthetic

    root = tmp_path_factory.mktemp(f"moe_import_{request.param}")
    if request.param == "qwen3_moe":
        hf, _, tokens = synthetic_moe_case(root)
    else:
        hf = make_synthetic(request.param, root / "hf", seed=2)
        tokens = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(9))
    cfg = modelopt_config(mtq, ["FP8_DEFAULT_CFG", "FP8_KV_CFG"])
    return modelopt_unified_export(mtq, export_hf_checkpoint, hf, cfg, tokens, root / "modelopt_fp8")


def _names(src: Path) -> tuple[str, str, str, str, int, int, int]:
    """(expert prefix, up, gate, down, experts, expert width, hidden) of a source."""
    cfg = json.loads((src / "config.json").read_text())
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return (*NAMES[cfg["model_type"]], experts, inter, cfg["hidden_size"])


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def edited(source, tmp_path_factory):
    layer, e, factor = EDITED
    pre, _, gate, _, _, _, _ = _names(source)
    name = pre.format(layer, e) + gate + ".weight_scale"
    return _edited(source, tmp_path_factory.mktemp("moe_edit") / "src", lambda t: t.__setitem__(name, t[name] * factor))


def _recipe(tmp_path: Path, source: Path, name: str) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(
        f"name: t\nwork_dir: {tmp_path / name}\ntarget: engine\nmodel:\n  source: {source}\n"
        "  dtype: bfloat16\nengine:\n  max_batch_size: 8\n  max_input_len: 64\n  max_seq_len: 128\n"
        "  max_num_tokens: 256\n"
    )
    return p


def _convert(src: Path, out: Path, tp: int = 1, moe_ep: int = -1, moe_tp: int = -1) -> Path:
    """ModelOpt's q/k/v scales differ and some tests edit an expert's: the requantization is accepted here."""
    return convert_source(src, out, tp=tp, moe_ep=moe_ep, moe_tp=moe_tp, allow_lossy=("fp8_requantize",))


def _fc_halves(t: dict, layer: int, e: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = t[f"transformer.layers.{layer}.mlp.fc.weight"][e]
    return w[:inter], w[inter:]  # [up; gate], the family rule's order


def test_expert_codes_and_scales_are_the_sources(source, tmp_path):
    """ModelOpt gives an expert's up and gate one scale: every code is copied, byte for byte; scales [E, 1] per
    expert, activation scales [1] the max over the experts; the router float32, unquantized."""
    pre_hf, up_n, gate_n, down_n, num, inter, hidden = _names(source)
    src = load_file(str(source / "model.safetensors"))
    ckpt = _convert(source, tmp_path / "tp1")
    t = load_file(str(ckpt / "rank0.safetensors"))
    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert (q["quant_algo"], q["kv_cache_quant_algo"]) == ("FP8", "FP8") and "*router" in q["exclude_modules"]
    for i in range(LAYERS):
        pre = f"transformer.layers.{i}.mlp."
        assert t[pre + "fc.weight"].dtype == torch.float8_e4m3fn
        assert t[pre + "fc.weight"].shape == (num, 2 * inter, hidden)
        assert t[pre + "proj.weight"].shape == (num, hidden, inter)
        assert t[pre + "router.weight"].dtype == torch.float32
        for linear in ("fc", "proj"):
            assert t[pre + f"{linear}.weights_scaling_factor"].shape == (num, 1)
            assert t[pre + f"{linear}.activation_scaling_factor"].shape == (1,)
        for e in range(num):
            hf = pre_hf.format(i, e)
            for got, proj in zip(_fc_halves(t, i, e, inter), (up_n, gate_n)):
                assert torch.equal(got.view(torch.uint8), src[hf + proj + ".weight"].view(torch.uint8)), (i, e, proj)
                assert float(t[pre + "fc.weights_scaling_factor"][e]) == float(src[hf + proj + ".weight_scale"])
            down = src[hf + down_n + ".weight"]
            assert torch.equal(t[pre + "proj.weight"][e].view(torch.uint8), down.view(torch.uint8))
            assert float(t[pre + "proj.weights_scaling_factor"][e]) == float(src[hf + down_n + ".weight_scale"])
        for linear, projs in (("fc", (up_n, gate_n)), ("proj", (down_n,))):
            inputs = [float(src[pre_hf.format(i, e) + p + ".input_scale"]) for e in range(num) for p in projs]
            assert float(t[pre + f"{linear}.activation_scaling_factor"]) == max(inputs)


def test_up_and_gate_of_different_scales_share_the_max(edited, tmp_path):
    """The edited expert's gate keeps its codes and (larger) scale; its up is requantized to it: within one FP8
    rounding (half an e4m3 step, 2^-4 relative, or half the smallest subnormal step 2^-10 x scale) of the source's
    up; at least one code moved; every other expert byte-identical."""
    layer, e, _ = EDITED
    pre_hf, up_n, gate_n, _, num, inter, _ = _names(edited)
    hf = pre_hf.format(layer, e)
    src = load_file(str(edited / "model.safetensors"))
    t = load_file(str(_convert(edited, tmp_path / "tp1") / "rank0.safetensors"))
    s_up, s_gate = (src[hf + p + ".weight_scale"].float() for p in (up_n, gate_n))
    assert float(s_gate) > float(s_up)
    s = t[f"transformer.layers.{layer}.mlp.fc.weights_scaling_factor"][e]
    assert float(s) == float(s_gate)
    up, gate = _fc_halves(t, layer, e, inter)
    assert torch.equal(gate.view(torch.uint8), src[hf + gate_n + ".weight"].view(torch.uint8))
    a = dequantize(up, s, "fp8", "tensor")
    b = dequantize(src[hf + up_n + ".weight"], s_up, "fp8", "tensor")
    assert bool(((a - b).abs() <= 2.0**-4 * torch.maximum(a.abs(), b.abs()) + 2.0**-10 * float(s)).all())
    assert bool((a != b).any())
    for other in range(num):
        if other != e:
            up_o, _ = _fc_halves(t, layer, other, inter)
            want = src[pre_hf.format(layer, other) + up_n + ".weight"]
            assert torch.equal(up_o.view(torch.uint8), want.view(torch.uint8)), other


def test_activation_scale_is_the_max_over_the_experts(source, tmp_path):
    """Per-expert input scales (trtpipe's own unified export writes them; ModelOpt's are equal): the MoE plugin has
    one per linear, their maximum over the experts and (fc) over up and gate."""
    pre_hf, up_n, gate_n, down_n, num, _, _ = _names(source)
    factors = {pre_hf.format(1, 2) + gate_n: 1.5, pre_hf.format(1, 0) + up_n: 0.5, pre_hf.format(0, 1) + down_n: 2.0}

    def edit(t):
        for module, f in factors.items():
            t[module + ".input_scale"] = t[module + ".input_scale"] * f

    src = _edited(source, tmp_path / "src", edit)
    stored = load_file(str(src / "model.safetensors"))
    t = load_file(str(_convert(src, tmp_path / "tp1") / "rank0.safetensors"))
    for i in range(LAYERS):
        for linear, projs in (("fc", (up_n, gate_n)), ("proj", (down_n,))):
            inputs = [float(stored[pre_hf.format(i, e) + p + ".input_scale"]) for e in range(num) for p in projs]
            assert float(t[f"transformer.layers.{i}.mlp.{linear}.activation_scaling_factor"]) == max(inputs)


def _weight(m) -> torch.Tensor:
    return torch.cat([p.weight for p in m.parts]) if hasattr(m, "parts") else m.weight


def _put_back(reference, converted, experts: tuple[tuple[int, int], ...]) -> None:
    """The converted (tp 1) checkpoint's requantized fused weights into the source's reference model: every layer's
    q/k/v and the up/gate of the (layer, expert) pairs in ``experts``; all other weights stay the source's."""
    for i, (ref, conv) in enumerate(zip(reference.layers, converted.layers)):
        pairs = [(ref.attention[0].qkv, _weight(conv.attention[0].qkv))]
        pairs += [(ref.mlp[0].fc[e], _weight(conv.mlp[0].fc[e])) for layer, e in experts if layer == i]
        for m, w in pairs:
            parts = m.parts if hasattr(m, "parts") else [m]
            for p, piece in zip(parts, w.split([p.weight.shape[0] for p in parts])):
                p.weight.data.copy_(piece)


@pytest.mark.parametrize("which", ["modelopt", "edited"])
def test_logits_at_tp1_moe_tp2_and_moe_ep2(source, edited, tmp_path, which):
    src = source if which == "modelopt" else edited
    reference = load_hf_checkpoint(src)
    requantized = (EDITED[:2],) if which == "edited" else ()
    _put_back(reference, load_checkpoint(_convert(src, tmp_path / "tp1")), requantized)
    with torch.no_grad():
        ref32 = reference.forward(IDS)
        ref64 = float64_copy(reference).forward(IDS)
    scale = error_scale(ref32, ref64)
    for tp, ep, mtp in ((1, 1, 1), (2, 1, 2), (2, 2, 1)):
        model = load_checkpoint(_convert(src, tmp_path / f"tp{tp}ep{ep}", tp=tp, moe_ep=ep, moe_tp=mtp))
        assert (model.args.moe_tp, model.args.moe_ep) == (mtp, ep)
        with torch.no_grad():
            assert_as_accurate(model.forward(IDS), ref64, scale, f"{which} tp{tp} moe_ep{ep} moe_tp{mtp}")


def test_excluded_experts_stay_float(source, tmp_path):
    """Experts left unquantized by the source (bf16, in its exclude list) beside FP8 attention: converted as float
    experts, named in exclude_modules, logits as the source's reference model (q/k/v put back as requantized)."""
    pre_hf, up_n, gate_n, down_n, num, _, _ = _names(source)

    def edit(t):
        for i in range(LAYERS):
            for e in range(num):
                for p in (up_n, gate_n, down_n):
                    m = pre_hf.format(i, e) + p
                    t[m + ".weight"] = dequantize(
                        t[m + ".weight"], t.pop(m + ".weight_scale").float(), "fp8", "tensor"
                    ).to(torch.bfloat16)
                    t.pop(m + ".input_scale")

    src = _edited(source, tmp_path / "src", edit)
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].append(pre_hf.format("*", "*") + "*")
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    ckpt = _convert(src, tmp_path / "tp1")
    excluded = json.loads((ckpt / "config.json").read_text())["quantization"]["exclude_modules"]
    assert {f"transformer.layers.{i}.mlp.{m}" for i in range(LAYERS) for m in ("fc", "proj")} <= set(excluded)
    # what makes TensorRT-LLM build the layer in float: the MixtureOfExperts module's own name (quantize_layers)
    assert {f"transformer.layers.{i}.mlp" for i in range(LAYERS)} <= set(excluded)
    assert load_file(str(ckpt / "rank0.safetensors"))["transformer.layers.0.mlp.fc.weight"].dtype == torch.bfloat16
    reference = load_hf_checkpoint(src)
    _put_back(reference, load_checkpoint(ckpt), ())
    with torch.no_grad():
        ref32 = reference.forward(IDS)
        ref64 = float64_copy(reference).forward(IDS)
        got = load_checkpoint(_convert(src, tmp_path / "ep2", tp=2, moe_ep=2, moe_tp=1)).forward(IDS)
    assert_as_accurate(got, ref64, error_scale(ref32, ref64), "excluded experts, moe_ep 2")


def test_experts_excluded_for_down_only_are_refused_and_nothing_written(source, tmp_path):
    """TensorRT-LLM quantizes a MoE layer as a whole: float down experts beside FP8 up/gate experts cannot be held
    by an engine checkpoint, so the conversion refuses in one line naming the layer, writing nothing."""
    pre_hf, _, _, down_n, num, _, _ = _names(source)

    def edit(t):
        for e in range(num):
            m = pre_hf.format(0, e) + down_n
            t[m + ".weight"] = dequantize(t[m + ".weight"], t.pop(m + ".weight_scale").float(), "fp8", "tensor").to(
                torch.bfloat16
            )
            t.pop(m + ".input_scale")

    src = _edited(source, tmp_path / "src", edit)
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"]["exclude_modules"].append(pre_hf.format(0, "*") + down_n)
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as exc:
        _convert(src, out)
    msg = str(exc.value)
    assert (
        "\n" not in msg
        and "layer 0: exclude_modules leaves the experts of mlp.proj unquantized but not those of mlp.fc" in msg
        and "quantizes a MoE layer as a whole" in msg
    ), msg
    assert not out.exists() and not any(tmp_path.glob(".out.tmp-*"))


def test_missing_expert_scale_is_named_and_nothing_written(source, tmp_path):
    pre_hf, _, gate_n, _, _, _, _ = _names(source)
    name = pre_hf.format(1, 3) + gate_n + ".weight_scale"
    bad = _edited(source, tmp_path / "src", lambda t: t.pop(name))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as exc:
        _convert(bad, out, tp=2, moe_ep=2, moe_tp=1)
    msg = str(exc.value)
    assert "\n" not in msg and f"tensor '{name}' is missing (FP8)" in msg, msg
    assert not out.exists() and not any(tmp_path.glob(".out.tmp-*"))


def test_int4_experts_are_refused_with_the_reason(source, tmp_path):
    """A ModelOpt W4A16_AWQ MoE source (its config: the refusal comes before any tensor is read) is refused for the
    engine target at validate (the FP8 source is not) and at conversion, in one line saying why (symmetric
    compressed-tensors / GPTQ experts convert: test_moe_int4_import.py)."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"].update(quant_algo="W4A16_AWQ", group_size=128)
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    why = (
        "its experts carry per-expert pre_quant_scale (ModelOpt W4A16_AWQ); TensorRT-LLM 1.2's MoE layer reads one "
        "pre-quant scale for all the experts of a linear, so they would have to be resmoothed into one and "
        "requantized, which trtpipe does not do (it writes W4A16 AWQ experts from its own calibration: "
        "quantization.algo int4_awq on the unquantized model; or use a symmetric compressed-tensors / GPTQ W4A16 "
        "source, whose experts convert exactly)"
    )
    assert moe_refusal(detect(src)) == why
    targets = {
        name: [
            x.message
            for x in check_recipe(load_recipe(_recipe(tmp_path, d, name), check_rules=False))
            if x.key == "target"
        ]
        for name, d in (("fp8", source), ("int4", src))
    }
    assert targets["fp8"] == [], targets
    assert len(targets["int4"]) == 1 and targets["int4"][0].endswith(
        f"its mixture-of-experts layers are refused for target engine: {why}"
    ), targets
    with pytest.raises(CheckpointError) as exc:
        _convert(src, tmp_path / "out")
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith(f"mixture-of-experts layers are not converted for the engine target: {why}")
    assert not (tmp_path / "out").exists()


def test_nvfp4_experts_are_refused_with_the_reason(source, tmp_path):
    """Dense NVFP4 converts for the engine target; an NVFP4 MoE source (its config: refused before any tensor is
    read) is refused at validate and at conversion, saying trtpipe writes no NVFP4 experts."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    hq = json.loads((src / "hf_quant_config.json").read_text())
    hq["quantization"].update(quant_algo="NVFP4", group_size=16)
    (src / "hf_quant_config.json").write_text(json.dumps(hq))
    why = moe_refusal(detect(src))
    assert why.startswith("trtpipe has no engine writer for NVFP4 experts") and why.endswith("use target: llmapi")
    targets = [
        x.message
        for x in check_recipe(load_recipe(_recipe(tmp_path, src, "nvfp4"), check_rules=False))
        if x.key == "target"
    ]
    assert len(targets) == 1 and targets[0].endswith(
        f"its mixture-of-experts layers are refused for target engine: {why}"
    ), targets
    with pytest.raises(CheckpointError) as exc:
        _convert(src, tmp_path / "out")
    assert "\n" not in str(exc.value) and str(exc.value).endswith(why)
    assert not (tmp_path / "out").exists()


def test_an_experts_up_gate_requantization_is_the_fp8_requantize_step(source, edited, tmp_path):
    """Fusing an expert's up and gate of different scales is the same lossy step as a dense q/k/v fusion: validate
    counts one more fused linear needing fp8_requantize on the edited source than on ModelOpt's own (the edited
    expert's fc), and the conversion without the key refuses in one line, writing nothing."""

    def lossy(d: Path, name: str) -> str:
        found = [
            x.message
            for x in check_recipe(load_recipe(_recipe(tmp_path, d, name), check_rules=False))
            if "fp8_requantize" in x.message
        ]
        assert len(found) == 1, found
        return found[0]

    def more(msg: str) -> int:
        return int(msg.split("(and ")[1].split(" more")[0]) if "(and " in msg else 0

    assert more(lossy(edited, "edited")) == more(lossy(source, "as_exported")) + 1
    with pytest.raises(CheckpointError) as exc:  # the other tests accept the step (_convert); nothing is here
        convert_source(edited, tmp_path / "out")
    assert "\n" not in str(exc.value) and "add fp8_requantize to model.allow_lossy_import" in str(exc.value)
    assert not (tmp_path / "out").exists()
