"""gpt-oss specifics the parity suite (tests/checkpoint/test_parity.py: tp1, tp2, tp2 x pp2, ep2) does not pin by
itself: MXFP4 decoding against transformers' own dequantizer, the shipped MXFP4 layout through conversion, the paged
KV pool's attention with sinks and sliding layers, parameter counts, and what validate refuses."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from numerics import assert_as_accurate, error_scale, float64_copy, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.cli import main
from trtpipe.models import num_params
from trtpipe.models.dims import read_hf_config
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.formats import mxfp4
from trtpipe.runtime import load_checkpoint

# OCP MX v1.0 E2M1 values by code (bit 3 = sign), written out here rather than taken from the module under test
E2M1_BY_CODE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _all_bytes_blocks(scales: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value (every (low, high) code pair) under each scale: blocks [1, S*16, 1, 16] (row r holds bytes
    16(r % 16) .. 16(r % 16) + 15, one group of 32 values), scales [1, S*16, 1] (the rows of scale i: 16i .. 16i+15)."""
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(len(scales), 1)  # [S*16, 16]
    sc = torch.tensor(scales, dtype=torch.uint8).repeat_interleave(16)  # [S*16]
    return codes.reshape(1, -1, 1, 16), sc.reshape(1, -1, 1)


# E8M0 exponents from 2^-126 to 2^125 (beyond, 6 * 2^e overflows float32; 255 is NaN in the format)
SCALES = [1, 64, 120, 126, 127, 128, 133, 200, 252]


def test_mxfp4_decode_every_code_and_exponent_as_the_format_defines():
    blocks, scales = _all_bytes_blocks(SCALES)
    got = mxfp4.dequantize(blocks, scales)  # [1, S*16, 32]
    for row in range(got.shape[1]):
        e = SCALES[row // 16] - 127
        for j in range(16):
            byte = int(blocks[0, row, 0, j])
            lo, hi = byte & 0xF, byte >> 4  # low nibble is the even element
            assert float(got[0, row, 2 * j]) == E2M1_BY_CODE[lo] * 2.0**e
            assert float(got[0, row, 2 * j + 1]) == E2M1_BY_CODE[hi] * 2.0**e
    # row 0 holds bytes 0..15: their low nibbles are the codes 0..15; code 8 is -0.0, which == cannot tell from +0.0
    assert torch.equal(torch.signbit(got[0, 0, 0::2]), torch.arange(16) >= 8)
    assert mxfp4.dequantize(blocks, scales, torch.float64).dtype == torch.float64


def test_mxfp4_decode_equals_transformers_dequantizer():
    """transformers 5.24 ``integrations.mxfp4.convert_moe_packed_tensors`` (what loads gpt-oss without MXFP4 kernels)
    returns the experts transposed to [E, in, out]; the values are the same bits."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 48, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 48, 4), generator=g, dtype=torch.uint8)
    scales[0, 0] = torch.tensor([1, 127, 200, 252], dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == (3, 48, 128) and torch.equal(ours.transpose(1, 2), theirs)
    with pytest.raises(ValueError, match=r"mxfp4: blocks \[3, 48, 4, 16\] and scales \[3, 48, 3\] do not form"):
        mxfp4.dequantize(blocks, scales[..., :3])


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    """The shipped layout (experts in MXFP4) and transformers' model on transformers' own dequantization of it."""
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gptoss_mx")
    mx = make_synthetic("gpt_oss_mxfp4", root / "mx", seed=5)
    hf = load_hf(make_synthetic("gpt_oss", root / "bf", seed=5))  # the same draw before MXFP4 rounding
    with safe_open(str(mx / "model.safetensors"), "pt") as f, torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(
                    convert_moe_packed_tensors(
                        f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales"), dtype=torch.float32
                    )
                )
    return mx, hf


def test_mxfp4_checkpoint_converts_exactly_and_runs_as_transformers(mxfp4_model, tmp_path):
    from safetensors import safe_open

    mx, hf = mxfp4_model
    with safe_open(str(mx / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks").shape == (8, 128, 2, 16)
        assert f.get_tensor("model.layers.0.mlp.experts.down_proj_scales").shape == (8, 64, 2)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    ckpt = convert(mx, tmp_path / "ckpt", tp=2, moe_ep=2, dtype="float32")
    # the runtime's experts are transformers' dequantized ones, bit for bit: fc = [up; gate] of each expert
    with safe_open(str(ckpt / "rank1.safetensors"), "pt") as f:
        fc = f.get_tensor("transformer.layers.3.mlp.fc.weight")  # rank 1 = experts 4..7
    gate_up = dict(hf.named_parameters())["model.layers.3.mlp.experts.gate_up_proj"].detach()[4:].transpose(1, 2)
    assert torch.equal(fc, torch.cat([gate_up[:, 1::2], gate_up[:, 0::2]], dim=1))
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref32, ref64 = hf(ids).logits, hf_float64(hf)(ids).logits
    assert_as_accurate(load_checkpoint(ckpt)(ids), ref64, error_scale(ref32, ref64), "gpt-oss MXFP4 tp2 ep2")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptoss")
    d = make_synthetic("gpt_oss", root / "hf", seed=2)
    hf = load_hf(d)
    return d, root, hf, hf_float64(hf)


def test_paged_step_logits_with_sinks_and_windows_as_accurate_as_transformers(gpt_oss):
    """The serving executor's paged attention (contexts longer than the window of 4, then their generation tokens
    batched) carries the sinks and each layer's window: logits against transformers float64 at tp2 x ep2."""
    from trtpipe.serving.api import StepBatch, StepEntry
    from trtpipe.serving.reference_engine import ReferenceEngine

    d, root, hf32, hf64 = gpt_oss
    model = load_checkpoint(convert(d, root / "tp2ep2", tp=2, moe_ep=2, dtype="float32"))
    assert [model.args.window(i) for i in range(4)] == [4, None, 4, None]
    engine = ReferenceEngine(model)
    engine.allocate(num_blocks=16, tokens_per_block=8)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 14, 20)]
    tables = [[4 * i + b for b in range(4)] for i in range(3)]
    got_ctx = engine.logits(StepBatch(0, [StepEntry(i, p, 0, tables[i], True, True) for i, p in enumerate(prompts)]))
    with torch.no_grad():
        ref_ctx = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in prompts])
    nxt = [int(t) for t in ref_ctx.argmax(-1)]
    got_gen = engine.logits(
        StepBatch(1, [StepEntry(i, [nxt[i]], len(p), tables[i], False, True) for i, p in enumerate(prompts)])
    )
    seqs = prompts + [p + [t] for p, t in zip(prompts, nxt)]
    with torch.no_grad():
        ref = torch.stack([hf64(torch.tensor([s])).logits[0, -1] for s in seqs])
        own = torch.stack([hf32(torch.tensor([s])).logits[0, -1] for s in seqs])  # transformers' float32
    assert_as_accurate(torch.cat([got_ctx, got_gen]), ref, error_scale(own, ref), "gpt-oss paged steps tp2 ep2")


def test_config_facts_and_parameter_count(gpt_oss):
    d, _, hf, _ = gpt_oss
    info = read_hf_config(d)
    assert (info.head_dim, info.num_experts, info.experts_per_token, info.sliding_window) == (8, 8, 2, 4)
    assert info.layer_types == ("sliding_attention", "full_attention") * 2
    assert info.rope_scaling["rope_type"] == "yarn" and info.rope_scaling["truncate"] is False
    assert num_params(info) == sum(p.numel() for p in hf.parameters())  # biases and sinks included


def _validate(tmp_path, hf_dir, body: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\n{body}model:\n  source: {hf_dir}\n")
    return CliRunner().invoke(main, ["validate", str(recipe)])


def test_validate_refuses_the_engine_target_and_names_llmapi(gpt_oss, tmp_path):
    d = gpt_oss[0]
    r = _validate(tmp_path, d, "target: engine\n")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert re.search(
        r"r\.yaml:2:9: target: engine: TensorRT-LLM 1\.2 has no TensorRT engine for GptOssForCausalLM "
        r".*; use target: llmapi$",
        lines[0],
    ), r.output
    assert _validate(tmp_path, d, "target: llmapi\n").exit_code == 0


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"layer_types": ["sliding_attention", "chunked_attention"] * 2},
            r"config.json: layer_types layer type\(s\) \['chunked_attention'\] \(known: sliding_attention, full_attention\)",
        ),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"config.json: quantization_config.quant_method 'fp8' is not supported for gpt-oss; allowed: mxfp4 or none",
        ),
    ],
)
def test_validate_refuses_what_the_family_cannot_honour(change, message, gpt_oss, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    cfg = json.loads((gpt_oss[0] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    r = _validate(tmp_path, d, "target: llmapi\n")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and re.search(rf"model\.source: {message}", lines[0]), r.output


# --- the llmapi export: experts as the source holds them (MXFP4 as shipped), the rest per the recipe -----------------


def _export(tmp_path, kind: str, algo: str):
    from trtpipe.export.unified import export_unified
    from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
    from trtpipe.quant.writer import TrtllmSource

    hf_dir = make_synthetic(kind, tmp_path / kind, seed=2)
    base = convert(hf_dir, tmp_path / "base", tp=2, moe_ep=2, dtype="float32")  # the export un-splits the experts
    stats = tmp_path / "stats"
    stats.mkdir()
    tokens = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(9))
    calibrate(
        TrtllmSource(base), tokens, CalibSettings(batch_size=4), on_layer=lambda i, st: save_layer_stats(stats, i, st)
    )
    out = tmp_path / "unified"
    out.mkdir()
    hq = export_unified(
        base, hf_dir, stats, out, algo=algo, kv_cache="none", group_size=128, alpha=0.5, exclude=["*lm_head"]
    )
    return hf_dir, base, out, hq


@pytest.mark.slow  # calibration of a 4-layer model per case
@pytest.mark.parametrize("kind", ["gpt_oss", "gpt_oss_mxfp4"])
def test_unquantized_export_is_the_source_checkpoint(kind, tmp_path):
    """Names, dtypes and bytes of every tensor as the source has them: bf16-style fused experts re-interleaved and
    in -> out again, MXFP4 blocks and scales copied; config.json keeps the hub's mxfp4 quantization_config (what
    TensorRT-LLM reads the experts from); the runtime computes the source model from it."""
    from safetensors import safe_open

    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    hf_dir, base, out, hq = _export(tmp_path, kind, "none")
    assert hq["quantization"]["quant_algo"] is None and not (out / "hf_quant_config.json").exists()
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(hf_dir / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())
        for k in g.keys():
            assert torch.equal(f.get_tensor(k), g.get_tensor(k)), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("quantization_config") == json.loads((hf_dir / "config.json").read_text()).get("quantization_config")
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    rt, ref = load_hf_checkpoint(out), load_checkpoint(base)
    with torch.no_grad():
        want = ref(ids)
    assert_as_accurate(rt(ids), want, error_scale(want, float64_copy(ref)(ids)), f"{kind} unified export")


@pytest.mark.slow  # calibration of a 4-layer model per case
def test_fp8_export_keeps_mxfp4_experts_and_quantizes_attention(tmp_path):
    """FP8 attention (codes, per-projection weight scale, static input scale) beside the experts as shipped: one
    quant_algo per module (MIXED_PRECISION, also in quant_cfg.json); router, sinks and lm_head stay unquantized.
    The runtime's q_proj computes exactly what the stored tensors say."""
    from safetensors import safe_open

    from trtpipe.formats.primitives import fake_quant
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    hf_dir, _, out, hq = _export(tmp_path, "gpt_oss_mxfp4", "fp8")
    q = hq["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    assert q["quantized_layers"]["model.layers.1.mlp.experts"] == {"quant_algo": "W4A16_MXFP4", "group_size": 32}
    assert q["quantized_layers"]["model.layers.1.self_attn.o_proj"] == {"quant_algo": "FP8"}
    assert {"lm_head", "model.layers.1.mlp.router"} <= set(q["exclude_modules"])
    assert json.loads((out / "quant_cfg.json").read_text())["quantized_layers"] == q["quantized_layers"]
    assert json.loads((out / "hf_quant_config.json").read_text()) == hq
    pre = "model.layers.1."
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(hf_dir / "model.safetensors"), "pt") as g:
        for k in (
            "mlp.experts.gate_up_proj_blocks",
            "mlp.experts.down_proj_scales",
            "mlp.router.weight",
            "self_attn.sinks",
        ):
            assert torch.equal(f.get_tensor(pre + k), g.get_tensor(pre + k)), k
        assert f.get_tensor(pre + "self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        codes, ws = f.get_tensor(pre + "self_attn.q_proj.weight"), f.get_tensor(pre + "self_attn.q_proj.weight_scale")
        s_in, bias = f.get_tensor(pre + "self_attn.q_proj.input_scale"), f.get_tensor(pre + "self_attn.q_proj.bias")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    want = fake_quant(x, s_in.reshape(1), "fp8") @ (codes.float() * ws).t() + bias
    got = load_hf_checkpoint(out).layers[1].attention[0].qkv(x)[:, :128]  # q's 16 heads x 8
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.slow  # calibration of a 4-layer model per case
def test_quantization_leaves_the_experts_as_the_export_keeps_them(tmp_path):
    """The quantized checkpoint the accuracy gate measures holds the experts unquantized (exclude_modules), as the
    llmapi export writes them, whatever the recipe's exclude list says; attention is FP8."""
    from safetensors import safe_open

    from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
    from trtpipe.quant.writer import TrtllmSource, quantize_checkpoint

    base = convert(make_synthetic("gpt_oss_mxfp4", tmp_path / "hf", seed=2), tmp_path / "base", dtype="float32")
    stats = tmp_path / "stats"
    stats.mkdir()
    tokens = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(9))
    calibrate(
        TrtllmSource(base), tokens, CalibSettings(batch_size=4), on_layer=lambda i, st: save_layer_stats(stats, i, st)
    )
    out = tmp_path / "q"
    cfg = quantize_checkpoint(
        base,
        TrtllmSource(base),
        stats,
        out,
        algo="fp8",
        kv_cache="none",
        group_size=128,
        alpha=0.5,
        exclude=["*lm_head"],
    )
    assert {"*lm_head", "*mlp.fc", "*mlp.proj"} <= set(cfg["quantization"]["exclude_modules"])
    with safe_open(str(out / "rank0.safetensors"), "pt") as f, safe_open(str(base / "rank0.safetensors"), "pt") as g:
        for name in ("transformer.layers.1.mlp.fc.weight", "transformer.layers.1.mlp.proj.weight"):
            assert torch.equal(f.get_tensor(name), g.get_tensor(name))
        assert f.get_tensor("transformer.layers.1.attention.qkv.weight").dtype == torch.float8_e4m3fn
