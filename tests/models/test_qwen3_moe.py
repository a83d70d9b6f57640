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
from trtpipe.models.hfconfig import read_hf_config
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
    assert info.num_params() == sum(p.numel() for p in hf.parameters())  # untied: embedding and lm_head both count
    ckpt = convert(hf_dir, tmp_path / "ckpt", tp=2, dtype="float32")  # moe_tp 2: each expert's 32 rows split
    from safetensors import safe_open

    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.fc.weight").shape == (8, 2 * 32 // 2, 64)
        assert f.get_tensor("transformer.layers.0.mlp.proj.weight").shape == (8, 64, 32 // 2)
        assert f.get_tensor("transformer.layers.0.mlp.router.weight").dtype == torch.float32


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [0]}, r"config.json: mlp_only_layers \[0\] \(dense MLP layers between MoE layers\) is not "
                               r"supported; allowed: \[\]"),
    ({"decoder_sparse_step": 2}, r"config.json: decoder_sparse_step 2 \(MoE every 2 layers\) is not supported; allowed: 1"),
    ({"architectures": ["Qwen3NextForCausalLM"]}, r"config.json: architectures\[0\] 'Qwen3NextForCausalLM' is not "
                                                  r"supported \(supported: .*Qwen3MoeForCausalLM\)"),
])
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
