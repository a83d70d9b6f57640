"""The streaming converter writes stacked MoE experts part by part (trtpipe/checkpoint/experts.py): every rank's
``mlp.fc`` / ``mlp.proj`` must be byte-identical to stacking the experts and splitting the stack
(``unsharded_layer`` + ``shard_for_rank``, the path quantization takes) for every moe_ep x moe_tp layout, and a
NaN in one expert is refused naming that expert's tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trtpipe.checkpoint.convert import convert, make_plan, shard_for_rank, unsharded_layer
from trtpipe.checkpoint.hf import HFReader
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import make_synthetic


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_synthetic("qwen3_moe", tmp_path_factory.mktemp("q") / "hf", seed=3)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return make_synthetic("mixtral", tmp_path_factory.mktemp("m") / "hf", seed=3)


@pytest.mark.parametrize(
    "kind, tp, moe_ep",
    [
        ("qwen3_moe", 4, 1),
        ("qwen3_moe", 4, 2),
        ("qwen3_moe", 4, 4),
        ("qwen3_moe", 1, 1),
        ("mixtral", 2, 2),
        ("mixtral", 2, 1),
    ],
)
def test_streamed_experts_equal_the_split_stack(kind, tp, moe_ep, qwen3_moe, mixtral, tmp_path):
    hf = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}[kind]
    ckpt = convert(hf, tmp_path / "ckpt", tp=tp, moe_ep=moe_ep, dtype="bfloat16")
    plan = make_plan(hf, tp=tp, moe_ep=moe_ep, dtype="bfloat16", source_dtype="float32")
    with HFReader(hf) as reader:
        for layer in range(plan.info.num_layers):
            whole = unsharded_layer(reader, plan, layer)
            for rank in range(tp):
                ref = shard_for_rank(whole, plan, rank)
                with safe_open(str(ckpt / f"rank{rank}.safetensors"), "pt") as f:
                    for name in (
                        f"transformer.layers.{layer}.mlp.fc.weight",
                        f"transformer.layers.{layer}.mlp.proj.weight",
                    ):
                        got, want = f.get_tensor(name), ref[name].to(torch.bfloat16)
                        assert got.shape == want.shape and torch.equal(got.view(torch.int16), want.view(torch.int16)), (
                            name,
                            rank,
                        )


def test_a_nan_in_one_expert_names_that_tensor(qwen3_moe, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(qwen3_moe, hf)
    path = next(hf.glob("*.safetensors"))
    state = load_file(path)
    state["model.layers.1.mlp.experts.5.down_proj.weight"][2, 7] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.5.down_proj.weight' contains NaN") as err:
        convert(hf, out, tp=2, moe_ep=2)
    assert "\n" not in str(err.value) and not out.exists()
