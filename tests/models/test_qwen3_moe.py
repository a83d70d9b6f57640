"""Qwen3-MoE specifics the parity suite (tests/checkpoint/test_parity.py) does not pin by itself: the routing
normalization follows ``norm_topk_prob`` (both settings against transformers float64, under expert parallelism), the
expert width is ``moe_intermediate_size`` everywhere sizes are derived, and layer patterns the TRT-LLM model cannot
express are refused at validate with the key."""

from __future__ import annotations

import json

import pytest
import torch

from numerics import assert_as_accurate, error_scale, hf_float64
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.checkpoint.convert import convert
from trtpipe.models import num_params
from trtpipe.models.dims import read_hf_config
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import load_checkpoint


@pytest.mark.parametrize("norm_topk_prob, mode", [(True, 1), (False, 0)])
def test_routing_normalization_follows_norm_topk_prob(norm_topk_prob, mode, tmp_path):
    hf_dir = make_synthetic("qwen3_moe", tmp_path / "hf", seed=2, norm_topk_prob=norm_topk_prob)
    ckpt = convert(hf_dir, tmp_path / "ckpt", tp=2, moe_ep=2, dtype="float32")
    assert json.loads((ckpt / "config.json").read_text())["moe"]["normalization_mode"] == mode
    hf = load_hf(hf_dir)
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref32, ref64 = hf(ids).logits, hf_float64(hf)(ids).logits
    assert_as_accurate(load_checkpoint(ckpt)(ids), ref64, error_scale(ref32, ref64), f"norm_topk_prob={norm_topk_prob}")


def test_expert_width_is_moe_intermediate_size(tmp_path):
    hf_dir = make_synthetic("qwen3_moe", tmp_path / "hf", seed=2)
    info = read_hf_config(hf_dir)
    assert (info.intermediate_size, info.expert_intermediate_size, info.num_experts) == (192, 32, 8)
    hf = load_hf(hf_dir)
    assert num_params(info) == sum(p.numel() for p in hf.parameters())  # untied: embedding and lm_head both count
    ckpt = convert(hf_dir, tmp_path / "ckpt", tp=2, dtype="float32")  # moe_tp 2: each expert's 32 rows split
    from safetensors import safe_open

    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.fc.weight").shape == (8, 2 * 32 // 2, 64)
        assert f.get_tensor("transformer.layers.0.mlp.proj.weight").shape == (8, 64, 32 // 2)
        assert f.get_tensor("transformer.layers.0.mlp.router.weight").dtype == torch.float32


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"mlp_only_layers": [0]},
            r"config.json: mlp_only_layers \[0\] \(dense MLP layers between MoE layers\) is not "
            r"supported; allowed: \[\]",
        ),
        (
            {"decoder_sparse_step": 2},
            r"config.json: decoder_sparse_step 2 \(MoE every 2 layers\) is not supported; allowed: 1",
        ),
        (
            {"architectures": ["Qwen3NextForCausalLM"]},
            r"config.json: architectures\[0\] 'Qwen3NextForCausalLM' is not "
            r"supported \(supported: .*Qwen3MoeForCausalLM\)",
        ),
    ],
)
def test_validate_refuses_what_the_family_cannot_honour(change, message, tmp_path):
    import re

    hf_dir = make_synthetic("qwen3_moe", tmp_path / "hf", seed=2)
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, **change}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\nmodel:\n  source: {hf_dir}\n")
    r = CliRunner().invoke(main, ["validate", str(recipe)])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and re.search(rf"r\.yaml:3:11: model\.source: {message}", lines[0]), r.output


# --- the llmapi export: each expert a module of its own, as ModelOpt's unified HF checkpoint writes it ------------


def _calibrated(tmp_path, samples: int, seq_len: int):
    from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats
    from trtpipe.quant.writer import TrtllmSource

    hf_dir = make_synthetic("qwen3_moe", tmp_path / "hf", seed=2)
    base = convert(hf_dir, tmp_path / "base", tp=2, moe_ep=2, dtype="float32")  # the export un-splits the experts
    stats = tmp_path / "stats"
    stats.mkdir()
    tokens = torch.randint(3, 250, (samples, seq_len), generator=torch.Generator().manual_seed(9))
    layers = calibrate(
        TrtllmSource(base), tokens, CalibSettings(batch_size=4), on_layer=lambda i, st: save_layer_stats(stats, i, st)
    )
    return hf_dir, base, stats, layers


def _export(hf_dir, base, stats, out, algo):
    from trtpipe.export.unified import export_unified

    out.mkdir()
    return export_unified(
        base, hf_dir, stats, out, algo=algo, kv_cache="none", group_size=128, alpha=0.5, exclude=["*lm_head"]
    )


def test_unquantized_export_runs_as_transformers(tmp_path):
    from safetensors import safe_open

    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    hf_dir, base, stats, _ = _calibrated(tmp_path, 4, 16)
    out = tmp_path / "unified"
    _export(hf_dir, base, stats, out, "none")
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(hf_dir / "model.safetensors"), "pt") as g:
        assert set(f.keys()) == set(g.keys())  # the HF names, per expert, router mlp.gate included
        for k in ("model.layers.1.mlp.experts.5.up_proj.weight", "model.layers.0.mlp.gate.weight"):
            assert torch.equal(f.get_tensor(k), g.get_tensor(k))
    hf = load_hf(hf_dir)
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref32, ref64 = hf(ids).logits, hf_float64(hf)(ids).logits
    assert_as_accurate(load_hf_checkpoint(out)(ids), ref64, error_scale(ref32, ref64), "qwen3_moe unified export")


def test_fp8_export_scales_each_expert_on_its_own_tokens(tmp_path):
    """Per expert: FP8 codes with a per-tensor weight scale its up and gate share, and a static input scale from the max |x|
    of the tokens calibration routed to that expert (up and gate share it); the router is not quantized."""
    from safetensors import safe_open

    from trtpipe.formats.primitives import fake_quant
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    hf_dir, base, stats, layers = _calibrated(tmp_path, 8, 32)
    out = tmp_path / "fp8"
    hq = _export(hf_dir, base, stats, out, "fp8")
    assert "model.layers.0.mlp.gate" in hq["quantization"]["exclude_modules"]
    fc_amax = layers[1].groups["mlp.fc+gate"].expert_amax
    assert bool((fc_amax > 0).all())  # 8 x 32 tokens, top-2 of 8: every expert saw some
    with safe_open(str(out / "model.safetensors"), "pt") as f, safe_open(str(hf_dir / "model.safetensors"), "pt") as g:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32  # the router, as the model's
        for e in (0, 7):
            pre = f"model.layers.1.mlp.experts.{e}."
            for proj in ("up_proj", "gate_proj"):
                codes, ws = f.get_tensor(pre + proj + ".weight"), f.get_tensor(pre + proj + ".weight_scale")
                assert codes.dtype == torch.float8_e4m3fn and ws.shape == ()
                w = g.get_tensor(pre + proj + ".weight")
                both = max(float(g.get_tensor(pre + p + ".weight").abs().amax()) for p in ("up_proj", "gate_proj"))
                assert float(ws) == pytest.approx(both / 448, rel=1e-6)  # the expert's fused gate_up scale
                # E4M3 rounds to nearest: within half a unit (2^-4 relative) of a normal code, 2^-10 x scale below
                err = (codes.float() * ws - w).abs()
                assert bool((err <= w.abs() * 2.0**-4 + float(ws) * 2.0**-10).all())
                assert float(f.get_tensor(pre + proj + ".input_scale")) == pytest.approx(
                    float(fc_amax[e]) / 448, rel=1e-6
                )
    rt = load_hf_checkpoint(out)  # the loader computes what the format says: fake-quantized input, dequantized W
    expert = rt.layers[1].mlp[0].fc[7]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        pre = "model.layers.1.mlp.experts.7."
        want = torch.cat(
            [
                fake_quant(x, f.get_tensor(pre + p + ".input_scale").reshape(1), "fp8")
                @ (f.get_tensor(pre + p + ".weight").float() * f.get_tensor(pre + p + ".weight_scale")).t()
                for p in ("up_proj", "gate_proj")
            ],
            dim=-1,
        )
    assert torch.allclose(expert(x), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_an_expert_no_calibration_token_reached_falls_back_to_the_whole_moe_input(tmp_path):
    from safetensors import safe_open

    hf_dir, base, stats, layers = _calibrated(tmp_path, 1, 2)  # 2 tokens, top-2 of 8: at most 4 experts see one
    g = layers[0].groups["mlp.fc+gate"]
    idle = (g.expert_amax == 0).nonzero().flatten().tolist()
    assert idle, "every expert saw a token: the fallback is not exercised"
    out = tmp_path / "fp8"
    _export(hf_dir, base, stats, out, "fp8")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for e in range(8):
            s = float(f.get_tensor(f"model.layers.0.mlp.experts.{e}.up_proj.input_scale"))
            want = float(g.amax.amax() if e in idle else g.expert_amax[e]) / 448
            assert s == pytest.approx(want, rel=1e-6) and 0 < s < float("inf")


def test_llmapi_validate_takes_fp8_moe_and_refuses_int4_and_w4a8_shapes_tensorrt_llm_cannot_load(tmp_path):
    hf_dir = make_synthetic("qwen3_moe", tmp_path / "hf", seed=2)
    head = f"name: t\ntarget: llmapi\nmodel:\n  source: {hf_dir}\nquantization:\n  calibration:\n    dataset: self\n"
    ok = tmp_path / "ok.yaml"
    ok.write_text(head + "  algo: fp8\n")
    assert CliRunner().invoke(main, ["validate", str(ok)]).exit_code == 0
    awq = tmp_path / "awq.yaml"
    awq.write_text(head + "  algo: int4_awq\n  group_size: 32\n")
    r = CliRunner().invoke(main, ["validate", str(awq)])
    assert r.exit_code == 2 and "int4_awq is refused for mixture-of-experts models on target llmapi" in r.output, (
        r.output
    )
    w4a8 = tmp_path / "w4a8.yaml"  # the synthetic model's hidden size, 64, is no multiple of 128
    w4a8.write_text(head + "  algo: w4a8_awq\n")
    r = CliRunner().invoke(main, ["validate", str(w4a8)])
    assert r.exit_code == 2 and "model.source: w4a8_awq: hidden_size 64 is not a multiple of 128" in r.output, r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(head + "  algo: int8_wo\n")
    r = CliRunner().invoke(main, ["validate", str(bad)])
    assert (
        r.exit_code == 2
        and "int8_wo: the llmapi export writes mixture-of-experts experts unquantized, in fp8, nvfp4 or w4a8_awq"
        in r.output
    ), r.output
