"""A pre-quantized checkpoint whose config contradicts its tensors, or a format trtpipe does not know, fails with
one line naming the tensor or key, and nothing is left where the converted checkpoint would have gone."""

from __future__ import annotations

import json
import shutil

import torch
from click.testing import CliRunner

from imported_helpers import conversion_refused, edited_copy
from trtpipe.cli import main


def test_missing_scale_is_named(tmp_path, unified):
    src = edited_copy(
        unified("fp8"), tmp_path / "src", edit_tensors=lambda t: t.pop("model.layers.2.self_attn.k_proj.weight_scale")
    )
    conversion_refused(src, tmp_path / "out", "tensor 'model.layers.2.self_attn.k_proj.weight_scale' is missing (FP8)")


def test_wrong_packed_shape_is_named(tmp_path, unified):
    name = "model.layers.1.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name].reshape(t[name].shape[0] * 2, -1)  # [out, in/2]: packed along the wrong axis

    src = edited_copy(unified("int4_wo"), tmp_path / "src", edit_tensors=edit)
    conversion_refused(src, tmp_path / "out", f"tensor '{name}' has shape [172, 32]", "stores [86, 64]")


def test_group_size_that_does_not_divide_is_named(tmp_path, unified):
    name = "model.layers.0.self_attn.q_proj.weight_scale"

    def edit(t):
        t[name] = torch.ones(64, 3)

    src = edited_copy(unified("int4_wo"), tmp_path / "src", edit_tensors=edit)
    conversion_refused(
        src, tmp_path / "out", f"{name}: shape [64, 3] does not give a group size that divides in_features 64"
    )


def test_config_group_size_contradicting_the_scales_is_named(tmp_path, unified):
    src = edited_copy(unified("int4_wo"), tmp_path / "src", edit_hq=lambda c: c["quantization"].update(group_size=32))
    conversion_refused(
        src, tmp_path / "out", "model.layers.0.self_attn.q_proj.weight_scale' has shape [64, 1], group size 32"
    )


def test_group_size_missing_is_named(tmp_path, unified):
    src = edited_copy(unified("w4a8_awq"), tmp_path / "src", edit_hq=lambda c: c["quantization"].pop("group_size"))
    conversion_refused(src, tmp_path / "out", "hf_quant_config.json: group_size is None; W4A8_AWQ needs")


def test_unknown_format_is_named_by_inspect_and_build(tmp_path, stories_dir):
    src = tmp_path / "bnb"
    shutil.copytree(stories_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["inspect", str(src)])
    assert r.exit_code != 0
    assert (
        r.output.strip()
        .splitlines()[-1]
        .endswith(
            "config.json: quantization_config.quant_method 'bitsandbytes' is not a format trtpipe knows "
            "(known: modelopt, compressed-tensors, awq, gptq, fbgemm_fp8, fp8, mxfp4)"
        )
    ), r.output


def test_a_tensor_the_format_does_not_have_is_named(tmp_path, unified):
    name = "model.layers.3.mlp.gate_proj.weight_zero_point"
    src = edited_copy(unified("int4_awq"), tmp_path / "src", edit_tensors=lambda t: t.update({name: torch.zeros(2)}))
    conversion_refused(
        src, tmp_path / "out", "tensor 'model.layers.3.mlp.gate_proj.weight_zero_point' is not part of W4A16_AWQ"
    )
