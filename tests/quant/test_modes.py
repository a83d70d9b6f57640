"""Every quantization mode x tp in {1, 2} on stories260k: tensor names, dtypes and shapes exactly as
MODELOPT_LAYOUTS.md lists them (per rank), dequantization within each format's error, tp-invariant outputs."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from numerics import assert_same_model
from quant_helpers import our_quant, our_stats
from trtpipe.formats.primitives import unpack_int4_rows
from trtpipe.checkpoint.shard import Layout, split_linear_tensor
from trtpipe.runtime import load_checkpoint

F32, BF16, I8, F8 = torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn
# MODELOPT_LAYOUTS.md §5/§7, per linear: suffix -> (dtype, shape kind). Kinds: w [out,in], w4 [out/2,in],
# one [1], out [out], in [in] (model dtype), grp [out, in/g].
SPEC = {
    "fp8": {"weight": (F8, "w"), "weights_scaling_factor": (F32, "one"), "activation_scaling_factor": (F32, "one")},
    "int8_sq": {
        "weight": (I8, "w"),
        "weights_scaling_factor": (F32, "out"),
        "prequant_scaling_factor": (BF16, "in"),
        "activation_scaling_factor": (F32, "one"),
    },
    "int8_wo": {"weight": (I8, "w"), "weights_scaling_factor": (F32, "out")},
    "int4_wo": {"weight": (I8, "w4"), "weights_scaling_factor": (F32, "grp"), "prequant_scaling_factor": (BF16, "in")},
    "int4_awq": {"weight": (I8, "w4"), "weights_scaling_factor": (F32, "grp"), "prequant_scaling_factor": (BF16, "in")},
    "w4a8_awq": {
        "weight": (I8, "w4"),
        "weights_scaling_factor": (F32, "grp"),
        "prequant_scaling_factor": (BF16, "in"),
        "activation_scaling_factor": (F32, "one"),
        "weights_scaling_factor_2": (F32, "one"),
    },
}
QUANT_ALGO = {
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16_AWQ",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
}
KV = {"fp8": "fp8", "int8_sq": "int8", "w4a8_awq": "fp8"}  # modes also run with a quantized KV cache
# stories260k per-rank (out, in) at tp: q 64 + k 32 + v 32 rows; intermediate 172; hidden 64
DIMS = {
    "attention.qkv": lambda tp: (128 // tp, 64),
    "attention.dense": lambda tp: (64, 64 // tp),
    "mlp.fc": lambda tp: (172 // tp, 64),
    "mlp.gate": lambda tp: (172 // tp, 64),
    "mlp.proj": lambda tp: (64, 172 // tp),
}
STYLE = {"attention.qkv": "qkv", "attention.dense": "row", "mlp.fc": "column", "mlp.gate": "column", "mlp.proj": "row"}
GROUP = 32
INT4_EXCLUDE = ("*lm_head", "*mlp.proj")  # 172 input features have no whole groups (see quant.rules)
# relative Frobenius error of dequantized weights (x pre-quant scale) against the bf16 originals
MAX_REL_ERR = {"fp8": 0.04, "int8_sq": 0.02, "int8_wo": 0.01, "int4_wo": 0.12, "int4_awq": 0.12, "w4a8_awq": 0.12}


def _shape(kind: str, out: int, inp: int) -> tuple:
    return {
        "w": (out, inp),
        "w4": (out // 2, inp),
        "one": (1,),
        "out": (out,),
        "in": (inp,),
        "grp": (out, inp // GROUP),
    }[kind]


@pytest.fixture(scope="module")
def quantized(stories_ckpts, stories_tokens, tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    stats = our_stats(stories_ckpts[1], stories_tokens["calib"], root / "stats", awq_group_size=GROUP)
    out = {}
    for algo in SPEC:
        int4 = algo in ("int4_wo", "int4_awq", "w4a8_awq")
        for tp in (1, 2):
            out[algo, tp] = our_quant(
                stories_ckpts[tp],
                stories_ckpts[1],
                stats,
                root / f"{algo}_tp{tp}",
                algo,
                kv=KV.get(algo, "none"),
                group_size=GROUP,
                exclude=INT4_EXCLUDE if int4 else ("*lm_head",),
            )
    return out


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("algo", list(SPEC))
def test_layout_per_rank(quantized, stories_ckpts, algo, tp):
    ckpt = quantized[algo, tp]
    import json

    q = json.loads((ckpt / "config.json").read_text())["quantization"]
    assert q["quant_algo"] == QUANT_ALGO[algo]
    assert q["kv_cache_quant_algo"] == {"fp8": "FP8", "int8": "INT8", None: None}[KV.get(algo)]
    assert "*lm_head" in q["exclude_modules"] and "*vocab_embedding" in q["exclude_modules"]
    if algo.startswith(("int4", "w4a8")):
        assert (q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == (GROUP, False, True)
    excluded = {"mlp.proj"} if algo.startswith(("int4", "w4a8")) else set()
    for rank in range(tp):
        base = load_file(str(stories_ckpts[tp] / f"rank{rank}.safetensors"))
        got = load_file(str(ckpt / f"rank{rank}.safetensors"))
        expected = {k: (t.dtype, tuple(t.shape)) for k, t in base.items()}
        for i in range(5):
            for lin, dims in DIMS.items():
                if lin in excluded:
                    continue
                name = f"transformer.layers.{i}.{lin}"
                for suffix, (dtype, kind) in SPEC[algo].items():
                    expected[f"{name}.{suffix}"] = (dtype, _shape(kind, *dims(tp)))
            if algo in KV:
                for s in ("k", "v", "kv"):
                    expected[f"transformer.layers.{i}.attention.{s}_cache_scaling_factor"] = (F32, (1,))
        assert {k: (t.dtype, tuple(t.shape)) for k, t in got.items()} == expected


def _dequantized(t: dict, name: str, algo: str) -> torch.Tensor:
    q, wsf = t[f"{name}.weight"], t[f"{name}.weights_scaling_factor"].float()
    if q.dtype == I8 and SPEC[algo]["weight"][1] == "w4":
        w = unpack_int4_rows(q).float() * wsf.repeat_interleave(GROUP, -1)
    elif wsf.numel() == 1:
        w = q.float() * wsf
    else:
        w = q.float() * wsf[:, None]
    if f"{name}.prequant_scaling_factor" in t:
        w = w * t[f"{name}.prequant_scaling_factor"].float()
    return w


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("algo", list(SPEC))
def test_dequantized_weights_within_format_error(quantized, stories_ckpts, algo, tp):
    full = load_file(str(stories_ckpts[1] / "rank0.safetensors"))
    layout = Layout(8, 4, 8, tp)
    worst = 0.0
    for rank in range(tp):
        got = load_file(str(quantized[algo, tp] / f"rank{rank}.safetensors"))
        for i in range(5):
            for lin in DIMS:
                name = f"transformer.layers.{i}.{lin}"
                if got[f"{name}.weight"].is_floating_point() and got[f"{name}.weight"].dtype != F8:
                    continue  # excluded, kept in bf16
                ref = split_linear_tensor(full[f"{name}.weight"].float(), "weight", STYLE[lin], rank, layout)
                rel = ((_dequantized(got, name, algo) - ref).norm() / ref.norm()).item()
                worst = max(worst, rel)
    print(f"{algo} tp={tp}: worst relative weight error {worst:.4f}")
    assert worst < MAX_REL_ERR[algo]


@pytest.mark.parametrize("algo", list(SPEC))
def test_tp2_runs_the_same_model_as_tp1(quantized, stories_tokens, algo):
    tokens = stories_tokens["heldout"][:2]
    assert_same_model(load_checkpoint(quantized[algo, 2]), load_checkpoint(quantized[algo, 1]), tokens, algo)


@pytest.mark.slow
def test_pipeline_parallel_and_kv_only(stories_ckpts, stories_tokens, quantized, tmp_path, stories_dir):
    """pp=2 places each quantized layer in its PP rank's file under its local index; a KV-cache-only
    quantization keeps every weight and adds the cache scales."""
    from trtpipe.checkpoint.convert import convert

    base_pp = convert(stories_dir, tmp_path / "pp2", tp=1, pp=2, dtype="bfloat16")
    stats = our_stats(stories_ckpts[1], stories_tokens["calib"][:4], tmp_path / "stats")
    pp = our_quant(base_pp, base_pp, stats, tmp_path / "fp8_pp2", "fp8", kv="fp8")
    flat = our_quant(stories_ckpts[1], stories_ckpts[1], stats, tmp_path / "fp8_pp1", "fp8", kv="fp8")
    r1 = load_file(str(pp / "rank1.safetensors"))
    assert r1["transformer.layers.0.attention.qkv.weight"].dtype == F8  # global layer 3 is rank 1's layer 0
    full = load_file(str(flat / "rank0.safetensors"))
    assert torch.equal(
        r1["transformer.layers.0.mlp.fc.weight"].view(torch.uint8),
        full["transformer.layers.3.mlp.fc.weight"].view(torch.uint8),
    )
    tokens = stories_tokens["heldout"][:2]
    assert_same_model(load_checkpoint(pp), load_checkpoint(flat), tokens, "fp8 pp=2")
    kv_only = our_quant(stories_ckpts[1], stories_ckpts[1], stats, tmp_path / "kv", "none", kv="int8")
    got, base = load_file(str(kv_only / "rank0.safetensors")), load_file(str(stories_ckpts[1] / "rank0.safetensors"))
    assert set(got) - set(base) == {
        f"transformer.layers.{i}.attention.{s}_cache_scaling_factor" for i in range(5) for s in ("k", "v", "kv")
    }
    assert all(torch.equal(got[k], base[k]) for k in base)
    import json

    q = json.loads((kv_only / "config.json").read_text())["quantization"]
    assert q["quant_algo"] is None and q["kv_cache_quant_algo"] == "INT8"
    m = load_checkpoint(kv_only)
    assert m(tokens).shape == (2, 64, 512)
