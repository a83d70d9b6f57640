"""Oracle: the unified HF export of a Qwen3-MoE model (synthetic, Qwen3-30B-A3B's ratios) against NVIDIA ModelOpt
0.47.0's ``export_hf_checkpoint`` of the same bf16 model, quantized with ``mtq.quantize`` on the same calibration
batches (ModelOpt 0.47 handles transformers 5's fused ``Qwen3MoeExperts`` on CPU as ``_QuantFusedExperts`` and
writes every expert's projections as modules of their own).

Identical: the file list, tensor names, dtypes and shapes (every expert's gate/up/down, the routers ``mlp.gate``
unquantized in the model dtype), hf_quant_config.json's ``quantization`` (its ``exclude_modules`` lists each layer's
router), config.json's inline ``quantization_config``; FP8 and NVFP4 weight codes and weight scales byte-identical
(functions of the same bf16 weights: NVFP4's ``weight_scale_2`` shared by an expert's up and gate). Activation
scales: attention's within the bf16-forward tolerance of the dense oracle (tests/export/test_unified_oracle.py);
the experts' are ours per expert (the tokens routed to each) where ModelOpt shares one per layer and projection, so
ours are at most ModelOpt's and their maximum over the experts equals it (TensorRT-LLM's fused MoE loads that
maximum)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from quant_helpers import (
    assert_same_layout,
    modelopt_unified_export,
    our_stats,
    raw_bytes,
    safetensors_of,
    synthetic_moe_case,
)
from trtpipe.checkpoint.convert import TOKENIZER_FILES
from trtpipe.export.unified import export_unified
from optional import needs

pytestmark = [pytest.mark.oracle, pytest.mark.slow, needs("modelopt")]

MODES = {"fp8": ("FP8_DEFAULT_CFG",), "nvfp4": ("NVFP4_DEFAULT_CFG",)}
LAYERS, EXPERTS = 2, 8
TOL = 2**-5  # bf16 forward (ModelOpt) against float32 (ours), as in the dense oracle


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    root = tmp_path_factory.mktemp("moe_oracle")
    hf, base, tokens = synthetic_moe_case(root)
    stats = our_stats(base, tokens, root / "stats")
    ours, theirs = {}, {}
    for mode, cfg_names in MODES.items():
        out = root / f"ours_{mode}"
        out.mkdir()
        export_unified(
            base, hf, stats, out, algo=mode, kv_cache="none", group_size=128, alpha=0.5, exclude=["*lm_head"]
        )
        ours[mode] = out
        cfg = copy.deepcopy(getattr(mtq, cfg_names[0]))
        theirs[mode] = modelopt_unified_export(mtq, export_hf_checkpoint, hf, cfg, tokens, root / f"modelopt_{mode}")
    return dict(hf=hf, base=base, ours=ours, theirs=theirs)


@pytest.mark.parametrize("mode", list(MODES))
def test_same_files_names_dtypes_shapes_and_configs(case, mode):
    a_dir, b_dir = case["ours"][mode], case["theirs"][mode]
    a, b = assert_same_layout(a_dir, b_dir, ignore=TOKENIZER_FILES)
    assert sum(".experts." in k and k.endswith(".weight") for k in a) == LAYERS * EXPERTS * 3
    assert a["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # the router, unquantized
    qa, qb = (json.loads((d / "hf_quant_config.json").read_text())["quantization"] for d in (a_dir, b_dir))
    assert qa == qb and {f"model.layers.{i}.mlp.gate" for i in range(LAYERS)} <= set(qa["exclude_modules"])
    ca, cb = (json.loads((d / "config.json").read_text())["quantization_config"] for d in (a_dir, b_dir))
    assert ca.pop("producer") != cb.pop("producer")
    assert ca == cb


@pytest.mark.parametrize("mode", list(MODES))
def test_codes_and_weight_scales_byte_identical(case, mode):
    a, b = safetensors_of(case["ours"][mode]), safetensors_of(case["theirs"][mode])
    codes = 0
    for k in a:
        if k.endswith(".input_scale"):
            continue
        assert torch.equal(raw_bytes(a[k]), raw_bytes(b[k])), k
        codes += k.endswith(".weight") and a[k].dtype in (torch.float8_e4m3fn, torch.uint8)
    assert codes == LAYERS * (4 + EXPERTS * 3)  # q, k, v, o and every expert's gate, up, down
    if mode == "nvfp4":
        for e in range(EXPERTS):
            pre = f"model.layers.1.mlp.experts.{e}."
            assert torch.equal(a[pre + "up_proj.weight_scale_2"], a[pre + "gate_proj.weight_scale_2"])


@pytest.mark.parametrize("mode", list(MODES))
def test_input_scales(case, mode):
    a, b = safetensors_of(case["ours"][mode]), safetensors_of(case["theirs"][mode])
    for i in range(LAYERS):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            k = f"model.layers.{i}.self_attn.{p}.input_scale"
            torch.testing.assert_close(a[k], b[k], rtol=TOL, atol=0)
        for p in ("gate_proj", "up_proj", "down_proj"):
            ours = torch.stack([a[f"model.layers.{i}.mlp.experts.{e}.{p}.input_scale"] for e in range(EXPERTS)])
            theirs = torch.stack([b[f"model.layers.{i}.mlp.experts.{e}.{p}.input_scale"] for e in range(EXPERTS)])
            assert bool((theirs == theirs[0]).all())  # ModelOpt: one per layer and projection
            assert bool((ours > 0).all()) and bool((ours <= theirs[0] * (1 + TOL)).all()), (i, p)
            torch.testing.assert_close(ours.amax(), theirs[0], rtol=TOL, atol=0)
            assert len(set(ours.tolist())) > 1, (i, p)  # really per expert


@pytest.mark.parametrize("mode", list(MODES))
def test_reference_loader_reads_both_exports(case, mode):
    """The reference runtime's unified-HF loader on ModelOpt's export and on ours: relative logit error against the
    unquantized model within the format's error and far below what a misread layout gives (a swapped up/gate, a
    wrong expert order or scale axis: > 40 %, as the dense oracle states). Bounds from the formats: E4M3 rounds
    weights and activations to within 2^-4 relative, so one FP8 product is within (1 + 2^-4)^2 - 1 = 0.13 and the
    logits of this 2-layer model within 0.2; E2M1 steps are up to 1/3 of a value (4 -> 6), halved by rounding to
    nearest, and most of a block sits below its max: within 0.4."""
    from trtpipe.runtime import load_checkpoint
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(5))
    ref = load_checkpoint(case["base"])(ids)
    errs = {
        who: ((load_hf_checkpoint(case[who][mode])(ids) - ref).norm() / ref.norm()).item() for who in ("ours", "theirs")
    }
    print(mode, errs)
    assert max(errs.values()) < (0.2 if mode == "fp8" else 0.4), errs
