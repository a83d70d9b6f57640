"""Oracle tests against NVIDIA ModelOpt 0.47.0 on the same calibration batches (stories260k and a synthetic
Llama whose dimensions are multiples of 128): identical tensor names/dtypes/shapes, FP8 codes and scales equal
within bf16 rounding, INT8 weight-only identical, INT4 packing identical for identical scales, and SmoothQuant /
AWQ held-out error no worse than ModelOpt's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from numerics import UBF16
from quant_helpers import kl_to_reference, modelopt_quant, our_quant, our_stats, self_tokens
from trtpipe.checkpoint.convert import convert
from trtpipe.formats.primitives import pack_int4_rows, quantize, unpack_int4_rows
from trtpipe.models.synthetic import make_synthetic
from trtpipe.runtime import load_checkpoint
from optional import needs

pytestmark = [pytest.mark.oracle, pytest.mark.slow, needs("modelopt")]

ALGOS = ("fp8", "int8_sq", "int8_wo", "int4_awq", "w4a8_awq")
# model -> (int4 group size, what is excluded from int4: stories' intermediate 172 has no whole groups)
CASES = {"stories": (32, ("*mlp.proj",)), "synth128": (128, ())}


@pytest.fixture(scope="module")
def modelopt():
    start = time.perf_counter()
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint

    print(f"modelopt import {time.perf_counter() - start:.1f} s")
    return mtq, export_tensorrt_llm_checkpoint


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, stories_dir, modelopt):
    """Both quantizers' checkpoints of one model for every algorithm, plus the unquantized logits."""
    name = request.param
    root = tmp_path_factory.mktemp(f"oracle_{name}")
    if name == "stories":
        hf = stories_dir
    else:
        hf = make_synthetic(
            "llama",
            root / "hf",
            seed=3,
            hidden_size=256,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            num_hidden_layers=2,
        )
    base = convert(hf, root / "base", tp=1, dtype="bfloat16")
    g = torch.Generator().manual_seed(11)
    if name == "stories":  # text the model writes is closer to real data than random ids
        calib, heldout = self_tokens(base, 16, 64, 0), self_tokens(base, 8, 64, 1)
    else:
        calib, heldout = torch.randint(3, 512, (16, 64), generator=g), torch.randint(3, 512, (8, 64), generator=g)
    group, int4_excl = CASES[name]
    stats = our_stats(base, calib, root / "stats")
    stats_awq = our_stats(base, calib, root / "stats_awq", awq_group_size=group)
    ours, theirs = {}, {}
    for algo in ALGOS:
        int4 = algo in ("int4_awq", "w4a8_awq")
        ours[algo] = our_quant(
            base,
            base,
            stats_awq if int4 else stats,
            root / f"ours_{algo}",
            algo,
            group_size=group,
            exclude=("*lm_head", *int4_excl) if int4 else ("*lm_head",),
        )
        hf_disable = tuple(p.replace("mlp.proj", "down_proj") + "*" for p in int4_excl) if int4 else ()
        theirs[algo] = modelopt_quant(
            *modelopt,
            hf,
            calib,
            algo,
            root / f"modelopt_{algo}",
            block_size=group if int4 else None,
            disable=hf_disable,
        )
    ref_logits = load_checkpoint(base)(heldout)
    return dict(name=name, hf=hf, base=base, ours=ours, theirs=theirs, heldout=heldout, ref=ref_logits, group=group)


NUM_LAYERS = 5  # the deepest model here (stories260k; synth128 has 2)


def _load(path: Path) -> dict:
    return load_file(str(path / "rank0.safetensors"))


@pytest.mark.parametrize("algo", ALGOS)
def test_same_tensors_dtypes_shapes(case, algo):
    a, b = _load(case["ours"][algo]), _load(case["theirs"][algo])
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_fp8_codes_and_scales(case):
    a, b = _load(case["ours"]["fp8"]), _load(case["theirs"]["fp8"])
    for k in a:
        if k.endswith(".weight") and a[k].dtype == torch.float8_e4m3fn:
            assert torch.equal(_bytes(a[k]), _bytes(b[k])), k
        elif k.endswith("weights_scaling_factor"):
            # amax of the same bf16 weights / 448: ModelOpt rounds the quotient to bf16 once
            torch.testing.assert_close(a[k], b[k], rtol=UBF16, atol=0)
        elif k.endswith("activation_scaling_factor"):
            # activations come from the forward pass: ours runs in float32, ModelOpt's in bf16, which rounds
            # the residual stream twice per layer (attention, MLP): up to 2 x layers x u_bf16 before the last
            # layer (measured: ~1 % on layer 4 of stories260k; the bound is 3.9 %)
            torch.testing.assert_close(a[k], b[k], rtol=2 * NUM_LAYERS * UBF16, atol=0)


def test_int8_weight_only_identical(case):
    a, b = _load(case["ours"]["int8_wo"]), _load(case["theirs"]["int8_wo"])
    for k in a:
        assert torch.equal(_bytes(a[k]), _bytes(b[k])), k


def test_int4_packing_identical_for_identical_scales(case):
    """ModelOpt's own packer and ours on the same weight and scales give the same bytes; and our unpacking of
    ModelOpt's checkpoint dequantizes back to the original weights."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    b, base, g = _load(case["theirs"]["int4_awq"]), _load(case["base"]), case["group"]
    name = "transformer.layers.0.attention.qkv"
    w = base[f"{name}.weight"].float() / b[f"{name}.prequant_scaling_factor"].float()
    wsf = b[f"{name}.weights_scaling_factor"]
    theirs = pack_int4_in_uint8(w, wsf, g)
    ours = pack_int4_rows(quantize(w, wsf, "int4", g))
    assert torch.equal(_bytes(ours), _bytes(theirs))
    deq = unpack_int4_rows(b[f"{name}.weight"]).float() * wsf.repeat_interleave(g, -1)
    deq = deq * b[f"{name}.prequant_scaling_factor"].float()
    rel = (deq - base[f"{name}.weight"].float()).norm() / base[f"{name}.weight"].float().norm()
    assert rel < 0.15, rel  # int4 noise; a wrong nibble order or row pairing gives > 100 %


@pytest.mark.parametrize("algo", ("int8_sq", "int4_awq", "w4a8_awq"))
def test_heldout_error_no_worse_than_modelopt(case, algo):
    ours = kl_to_reference(case["ref"], case["ours"][algo], case["heldout"])
    theirs = kl_to_reference(case["ref"], case["theirs"][algo], case["heldout"])
    print(f"{case['name']} {algo}: held-out KL ours {ours:.6f} modelopt {theirs:.6f}")
    assert ours <= theirs * 1.02, (ours, theirs)
