"""ModelOpt NVFP4 (unified HF) -> the engine target's TensorRT-LLM checkpoint, on ModelOpt 0.47's own export of the
synthetic Qwen3 (tests/prequantized.py; every linear quantized, q/k/v and gate/up sharing their global scales as
ModelOpt's export makes them).

Pinned here: the per-rank layout at tp 1 and tp 2 (names, dtypes, shapes: ``weight`` U8 [out, in/2],
``weights_scaling_factor`` F8_E4M3 [out, in/16], ``weights_scaling_factor_2`` and ``activation_scaling_factor``
F32 [1], as TensorRT-LLM 1.2.0rc2's ``preprocess_perlayer_weights`` reads them), the codes and block scales
byte-equal to the source's rows / input blocks of that rank, the scalars equal to the source's; the twin's logits
on the converted checkpoint (tp 1, tp 2 x pp 2, tp 4 with KV heads replicated) against the source as stored by the reference runtime, both in
float64, within the source's own float32 error scale (tests/numerics.py: an exact re-layout is off by summation
order only; a wrong nibble, block or shard is off by 1e-1); bad input named in one line with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from imported_helpers import IDS, conversion_refused, convert_source, edited_copy, linear_weights
from numerics import assert_as_accurate, error_scale, float64_copy
from prequantized import prequantized
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

pytestmark = pytest.mark.slow

NAME = "modelopt-nvfp4-qwen3"
LAYERS = 2
# TRT-LLM linear -> (HF projections in fused order, split style)
LINEARS = {
    "attention.qkv": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column"),
    "attention.dense": (("self_attn.o_proj",), "row"),
    "mlp.fc": (("mlp.gate_proj",), "column"),
    "mlp.gate": (("mlp.up_proj",), "column"),
    "mlp.proj": (("mlp.down_proj",), "row"),
}
SUFFIXES = {
    "weight": torch.uint8,
    "weights_scaling_factor": torch.float8_e4m3fn,
    "weights_scaling_factor_2": torch.float32,
    "activation_scaling_factor": torch.float32,
}


@pytest.fixture(scope="module")
def source() -> Path:
    return prequantized(NAME)


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("nvfp4")
    return {tp: convert_source(source, root / f"tp{tp}", tp=tp) for tp in (1, 2)}


def _rank_slice(t: torch.Tensor, style: str, rank: int, tp: int) -> torch.Tensor:
    """The rank's piece of one source tensor: rows for column linears, input bytes / blocks for row linears (the
    Qwen3 fixture has 2 KV heads, so tp 2 splits k/v like q: no KV-head replication)."""
    dim = 0 if style == "column" else 1
    return t.chunk(tp, dim=dim)[rank]


def test_layout_and_bytes_per_rank(source, converted):
    src = load_file(str(source / "model.safetensors"))
    for tp, ckpt in converted.items():
        q = json.loads((ckpt / "config.json").read_text())["quantization"]
        assert (q["quant_algo"], q["kv_cache_quant_algo"], q["group_size"]) == ("NVFP4", None, 16), q
        for rank in range(tp):
            got = load_file(str(ckpt / f"rank{rank}.safetensors"))
            for layer in range(LAYERS):
                for linear, (hf, style) in LINEARS.items():
                    base = f"transformer.layers.{layer}.{linear}"
                    mine = {k[len(base) + 1 :]: v for k, v in got.items() if k.startswith(base + ".")}
                    assert {s: t.dtype for s, t in mine.items()} == SUFFIXES, (tp, rank, base)
                    pre = [f"model.layers.{layer}.{h}" for h in hf]
                    for ours, theirs in (("weight", "weight"), ("weights_scaling_factor", "weight_scale")):
                        want = torch.cat([_rank_slice(src[f"{p}.{theirs}"], style, rank, tp) for p in pre])
                        assert mine[ours].shape == want.shape, (tp, rank, base, ours)
                        assert torch.equal(mine[ours].view(torch.uint8), want.view(torch.uint8)), (tp, rank, base, ours)
                    for ours, theirs in (
                        ("weights_scaling_factor_2", "weight_scale_2"),
                        ("activation_scaling_factor", "input_scale"),
                    ):
                        assert mine[ours].shape == (1,) and float(mine[ours]) == float(src[f"{pre[0]}.{theirs}"])
    # the shapes the layers declare, at tp 2 (q 256 + k 64 + v 64 rows, hidden 128, intermediate 256)
    r1 = load_file(str(converted[2] / "rank1.safetensors"))
    shapes = {
        k.split(".", 3)[3]: list(v.shape)
        for k, v in r1.items()
        if k.startswith("transformer.layers.0.")
        and k.endswith(("weight", "weights_scaling_factor"))
        and "layernorm" not in k
    }
    assert shapes == {
        "attention.qkv.weight": [192, 64],
        "attention.qkv.weights_scaling_factor": [192, 8],
        "attention.dense.weight": [128, 64],
        "attention.dense.weights_scaling_factor": [128, 8],
        "mlp.fc.weight": [128, 64],
        "mlp.fc.weights_scaling_factor": [128, 8],
        "mlp.gate.weight": [128, 64],
        "mlp.gate.weights_scaling_factor": [128, 8],
        "mlp.proj.weight": [128, 64],
        "mlp.proj.weights_scaling_factor": [128, 8],
    }, shapes


def test_twin_logits_equal_the_source_as_stored(source, converted, tmp_path):
    hf = load_hf_checkpoint(source)
    ours = linear_weights(load_checkpoint(converted[1]))
    for name, w in linear_weights(hf).items():  # the same dequantization of the same codes and scales: bit for bit
        assert torch.equal(ours[name], w), name
    with torch.no_grad():
        ref32, ref64 = hf.forward(IDS), float64_copy(hf).forward(IDS)
        scale = error_scale(ref32, ref64)
        # tp 4: 2 KV heads, so each k/v head (its codes and block scales) is replicated to two ranks
        for what, ckpt in (
            ("tp1", converted[1]),
            ("tp2 pp2", convert_source(source, tmp_path / "tp2pp2", tp=2, pp=2)),
            ("tp4", convert_source(source, tmp_path / "tp4", tp=4)),
        ):
            got = float64_copy(load_checkpoint(ckpt)).forward(IDS)
            assert_as_accurate(got, ref64, scale, f"NVFP4 engine checkpoint {what}")


def test_missing_global_scale_is_named(source, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight_scale_2"
    conversion_refused(
        edited_copy(source, tmp_path / "src", lambda t: t.pop(name)),
        tmp_path / "out",
        f"tensor '{name}' is missing (NVFP4)",
    )


def test_wrong_packed_shape_is_named(source, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name].reshape(t[name].shape[0] // 2, -1)  # [out/2, in]: packed along the wrong axis

    conversion_refused(
        edited_copy(source, tmp_path / "src", edit),
        tmp_path / "out",
        f"tensor '{name}' has shape [128, 128], NVFP4 of a [256, 128] projection stores [256, 64]",
    )


def test_fused_members_with_different_global_scales_are_refused(source, tmp_path):
    name = "model.layers.0.self_attn.v_proj.weight_scale_2"
    src = edited_copy(source, tmp_path / "src", lambda t: t.update({name: t[name] * 2}))
    conversion_refused(
        src,
        tmp_path / "out",
        "model.layers.0.self_attn: q_proj/k_proj/v_proj weight_scale_2 differ",
        "TensorRT-LLM's NVFP4 attention.qkv keeps one per fused linear",
        "target: llmapi",
    )
