"""INT4 AWQ experts on the engine target (synthetic Qwen3-MoE): the TensorRT-LLM checkpoint ``trtllm-build`` 1.2 loads.

Layout (trtpipe.checkpoint.quant_layouts, from upstream source): per rank, ``mlp.fc.weight`` I8 [E_r, I_r, H] (the
[up; gate] rows of each expert, two rows per byte), ``mlp.fc.weights_scaling_factor`` F32 [E_r, 2 I_r, H/g],
``mlp.fc.prequant_scaling_factor`` bf16 [H] shared by the experts; ``mlp.proj`` the same with [E_r, H/2, I_r],
[E_r, H, I_r/g], [I_r]. The builder's ``preprocess_perlayer_weights`` (NVIDIA/TensorRT-LLM@b35ac1b6
``tensorrt_llm/models/modeling_utils.py``) transposes these into ``MOEWeightWrapper``'s parameters
(NVIDIA/TensorRT-LLM@c388fec7 ``tensorrt_llm/layers/moe.py``): weight [E_r, in, out/4] in the model dtype, scales
[E_r, in/g, out], pre-quant scale [1, in] (a stacked [E, in] one keeps its row 0). The codes are ModelOpt 0.47's own
3-D packing (``to_quantized_weight`` -> ``pack_int4_in_uint8``) of the same ``W / pqs`` and scales.

Numerics: the reference runtime (the CPU twin) on the checkpoint at tp1, moe_tp 2 and moe_ep 2 against transformers
in float64 with every quantized weight replaced by its dequantized value ``codes x group scale x pre-quant scale``
(AWQ's ``(x * pqs) W_q^T`` is exactly ``x (W_q * pqs)^T``: the same function), the other weights as the checkpoint
holds them (bf16; the router float32). Bound (tests/numerics.py): ORDER_FACTOR x transformers' own float32 error on
that same dequantized model; a wrong code, scale, shard or shared pre-quant row is off by orders of magnitude more.
Group 16 on the synthetic widths (H 64, expert 32): moe_tp 2 leaves 16 input features of down_proj per rank. Mixtral
(TRT-LLM's LLaMAForCausalLM, the same MoE layer) is checked the same way at tp1 and moe_ep 2.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from numerics import assert_as_accurate, error_scale, hf_float64
from quant_helpers import our_quant, our_stats, synthetic_moe_case
from trtpipe.checkpoint.convert import convert
from trtpipe.formats.primitives import choose_qparams, quantize, unpack_int4_rows
from trtpipe.cli import main
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.quant.calibrate import load_layer_stats
from trtpipe.runtime import load_checkpoint

G, LAYERS, EXPERTS, HIDDEN, WIDTH = 16, 2, 8, 64, 32
LAYOUTS = {"tp1": dict(tp=1), "mtp2": dict(tp=2, moe_ep=1, moe_tp=2), "ep2": dict(tp=2, moe_ep=2, moe_tp=1)}
# per layout: (experts per rank, expert width per rank)
PER_RANK = {"tp1": (EXPERTS, WIDTH), "mtp2": (EXPERTS, WIDTH // 2), "ep2": (EXPERTS // 2, WIDTH)}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_awq_engine")
    hf, base, tokens = synthetic_moe_case(root)
    stats = our_stats(base, tokens, root / "stats", awq_group_size=G)
    bases = {"tp1": base}
    for name, kw in LAYOUTS.items():
        if name != "tp1":
            bases[name] = convert(hf, root / f"base_{name}", dtype="bfloat16", **kw)
    quant = {
        name: our_quant(b, base, stats, root / f"awq_{name}", "int4_awq", group_size=G) for name, b in bases.items()
    }
    return dict(hf=hf, base=base, stats=stats, quant=quant, root=root)


def _moe_tensors(path, layer: int) -> dict[str, torch.Tensor]:
    p = f"transformer.layers.{layer}.mlp."
    return {k[len(p) :]: v for k, v in load_file(str(path)).items() if k.startswith(p)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_is_what_trtllm_build_preprocesses_into_the_moe_layer(case, layout):
    e_r, w_r = PER_RANK[layout]
    for rank in range(LAYOUTS[layout]["tp"]):
        for i in range(LAYERS):
            t = _moe_tensors(case["quant"][layout] / f"rank{rank}.safetensors", i)
            assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
                "router.weight": (torch.float32, (EXPERTS, HIDDEN)),
                "fc.weight": (torch.int8, (e_r, 2 * w_r // 2, HIDDEN)),
                "fc.weights_scaling_factor": (torch.float32, (e_r, 2 * w_r, HIDDEN // G)),
                "fc.prequant_scaling_factor": (torch.bfloat16, (HIDDEN,)),
                "proj.weight": (torch.int8, (e_r, HIDDEN // 2, w_r)),
                "proj.weights_scaling_factor": (torch.float32, (e_r, HIDDEN, w_r // G)),
                "proj.prequant_scaling_factor": (torch.bfloat16, (w_r,)),
            }, (layout, rank, i)
            # preprocess_perlayer_weights (W4A16_AWQ) on these, shape for shape, gives MOEWeightWrapper's parameters:
            # int8 weight -> transpose(-1, -2) -> preprocess_weights_for_mixed_gemm (same shape) -> view(bf16), half
            # the last dim; scales transpose(-1, -2); a pre-quant scale reshape(1, -1) (its row 0 when 2-D)
            for lin, (in_f, out_f) in (("fc", (HIDDEN, 2 * w_r)), ("proj", (w_r, HIDDEN))):
                w = t[f"{lin}.weight"].transpose(-1, -2).contiguous().view(torch.bfloat16)
                assert tuple(w.shape) == (e_r, in_f, out_f // 4)  # MOEWeightWrapper: (experts, in, out // 4)
                assert tuple(t[f"{lin}.weights_scaling_factor"].transpose(-1, -2).shape) == (e_r, in_f // G, out_f)
                assert tuple(t[f"{lin}.prequant_scaling_factor"].reshape(1, -1).shape) == (1, in_f)
    cfg = json.loads((case["quant"][layout] / "config.json").read_text())
    q = cfg["quantization"]
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == (
        "W4A16_AWQ",
        G,
        False,
        True,
    )
    assert {"*lm_head", "*router"} <= set(q["exclude_modules"])
    # TensorRT-LLM re-creates a MoE layer whose name an exclude pattern matches as float: none may
    assert not any(
        fnmatch.fnmatchcase(f"transformer.layers.{i}.{n}", p)
        for p in q["exclude_modules"]
        for i in range(LAYERS)
        for n in ("mlp", "mlp.fc", "mlp.proj")
    )


def _float_experts(base, layer: int) -> dict[str, torch.Tensor]:
    src = load_file(str(base / "rank0.safetensors"))
    return {lin: src[f"transformer.layers.{layer}.mlp.{lin}.weight"].float() for lin in ("fc", "proj")}


def test_codes_and_scales_are_consistent_and_the_pre_quant_scale_is_the_calibrated_one(case):
    """Codes are the round-to-nearest of ``W / pqs`` on the stored group scales (every code in -8..7, every scale
    positive and finite); the one pre-quant scale per linear is calibration's mean over the experts (stored bf16);
    each expert's scales come from its own clip search for that scale; the moe_tp / moe_ep ranks hold exactly the
    slices of the tp1 tensors (the split happens before quantization and changes no number)."""
    for i in range(LAYERS):
        t = _moe_tensors(case["quant"]["tp1"] / "rank0.safetensors", i)
        st = load_layer_stats(case["stats"], i).groups
        for lin, group in (("fc", "mlp.fc+gate"), ("proj", "mlp.proj")):
            w, wsf = _float_experts(case["base"], i)[lin], t[f"{lin}.weights_scaling_factor"]
            pqs = t[f"{lin}.prequant_scaling_factor"]
            assert torch.equal(pqs, st[group].awq_pqs.to(torch.bfloat16)), (i, lin)
            assert bool((pqs.float() > 0).all()) and not bool((pqs.float() == 1).all())
            assert bool(torch.isfinite(wsf).all()) and bool((wsf > 0).all())
            codes = unpack_int4_rows(t[f"{lin}.weight"])
            assert tuple(codes.shape) == tuple(w.shape) and int(codes.min()) >= -8 and int(codes.max()) <= 7
            assert torch.equal(codes, quantize(w / pqs.float(), wsf, "int4", G)), (i, lin)
        amax = load_layer_stats(case["stats"], i).groups["mlp.proj"].awq_amax["mlp.proj"]
        assert torch.equal(t["proj.weights_scaling_factor"], choose_qparams(amax, "int4")), i  # its clip search
    one = {i: _moe_tensors(case["quant"]["tp1"] / "rank0.safetensors", i) for i in range(LAYERS)}
    for layout in ("mtp2", "ep2"):
        e_r, w_r = PER_RANK[layout]
        for rank in range(2):
            ep, mtp = (rank, 0) if layout == "ep2" else (0, rank)
            ex = slice(ep * e_r, (ep + 1) * e_r)
            for i in range(LAYERS):
                got, full = _moe_tensors(case["quant"][layout] / f"rank{rank}.safetensors", i), one[i]
                up, gate = (x[ex] for x in unpack_int4_rows(full["fc.weight"]).chunk(2, dim=1))
                rows = slice(mtp * w_r, (mtp + 1) * w_r)
                assert torch.equal(unpack_int4_rows(got["fc.weight"]), torch.cat([up[:, rows], gate[:, rows]], 1))
                s_up, s_gate = (x[ex] for x in full["fc.weights_scaling_factor"].chunk(2, dim=1))
                assert torch.equal(got["fc.weights_scaling_factor"], torch.cat([s_up[:, rows], s_gate[:, rows]], 1))
                assert torch.equal(got["fc.prequant_scaling_factor"], full["fc.prequant_scaling_factor"])
                assert torch.equal(got["proj.weight"], full["proj.weight"][ex, :, rows])
                g_rows = slice(mtp * w_r // G, (mtp + 1) * w_r // G)
                assert torch.equal(
                    got["proj.weights_scaling_factor"], full["proj.weights_scaling_factor"][ex, :, g_rows]
                )
                assert torch.equal(got["proj.prequant_scaling_factor"], full["proj.prequant_scaling_factor"][rows])


@pytest.mark.oracle
def test_codes_identical_to_modelopt_packing_of_stacked_experts(case):
    """ModelOpt 0.47's own ``to_quantized_weight(W / pqs, weights_scaling_factor, "int4_awq", block_size=G)`` on the
    stacked [E, out, in] float32 experts (its 3-D ``pack_int4_in_uint8`` branch, the TRT-LLM checkpoint export's),
    viewed as int8 as ``pack_linear_weights`` stores it, is our ``mlp.fc.weight`` / ``mlp.proj.weight`` byte for
    byte."""
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    for i in range(LAYERS):
        t = _moe_tensors(case["quant"]["tp1"] / "rank0.safetensors", i)
        for lin, w in _float_experts(case["base"], i).items():
            wq = w / t[f"{lin}.prequant_scaling_factor"].float()
            theirs = quant_utils.to_quantized_weight(wq, t[f"{lin}.weights_scaling_factor"], "int4_awq", None, G)
            assert theirs.dim() == 3 and torch.equal(theirs.view(torch.int8), t[f"{lin}.weight"]), (i, lin)


def _dequantized(t: dict[str, torch.Tensor], lin: str) -> torch.Tensor:
    """float64 ``codes x group scale x pre-quant scale`` of a W4A16_AWQ linear (experts stacked or not)."""
    codes = unpack_int4_rows(t[f"{lin}.weight"]).double()
    wsf = t[f"{lin}.weights_scaling_factor"].double().repeat_interleave(G, dim=-1)
    return codes * wsf * t[f"{lin}.prequant_scaling_factor"].double()


def _fake_quant_hf(hf_dir, quant_dir):
    """transformers' model (Qwen3-MoE or Mixtral: fused ``experts.gate_up_proj`` [E, 2I, H] = [gate; up] and
    ``down_proj``) holding a tp1 checkpoint's weights: every quantized linear dequantized, the rest as stored (bf16;
    the router float32, as transformers' weight already is); in float32 and float64."""
    hf = load_hf(hf_dir)
    cfg = hf.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    src = load_file(str(quant_dir / "rank0.safetensors"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("mlp.gate.weight"):  # the router: float32 in the checkpoint
                p.copy_(p.to(torch.bfloat16).float())
        for i, layer in enumerate(hf.model.layers):
            pre = f"transformer.layers.{i}."
            t = {k[len(pre) :]: v for k, v in src.items() if k.startswith(pre)}
            qkv = _dequantized(t, "attention.qkv")
            for proj, w in zip(("q_proj", "k_proj", "v_proj"), qkv.split([q, kv, kv])):
                getattr(layer.self_attn, proj).weight.copy_(w)
            layer.self_attn.o_proj.weight.copy_(_dequantized(t, "attention.dense"))
            up, gate = _dequantized(t, "mlp.fc").chunk(2, dim=1)  # ours [up; gate], transformers [gate; up]
            layer.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
            layer.mlp.experts.down_proj.copy_(_dequantized(t, "mlp.proj"))
            assert torch.equal(layer.mlp.gate.weight, t["mlp.router.weight"])
    return hf.eval(), hf_float64(hf).eval()


def _assert_twin_is_the_fake_quant_model(hf_dir, base, quant: dict, ids: torch.Tensor):
    hf32, hf64 = _fake_quant_hf(hf_dir, quant["tp1"])
    with torch.no_grad():
        ref32, ref64 = hf32(ids).logits, hf64(ids).logits
        scale = error_scale(ref32, ref64)
        unquantized = load_checkpoint(base)(ids).double()
    assert float((ref64 - unquantized).abs().max()) > 100 * scale  # int4 moved the logits far beyond the bound
    for layout, path in quant.items():
        with torch.no_grad():
            err = assert_as_accurate(load_checkpoint(path)(ids), ref64, scale, f"int4_awq experts, {layout}")
        print(layout, dict(err=err, scale=scale))


def test_twin_executes_the_layout_exactly_at_tp1_moe_tp2_and_ep2(case):
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    _assert_twin_is_the_fake_quant_model(case["hf"], case["base"], case["quant"], ids)


def test_mixtral_experts_the_same_way(tmp_path):
    """Mixtral (TRT-LLM's LLaMAForCausalLM with the same MoE layer): the same layout, the twin at tp1 and moe_ep 2
    the fake-quant model (4 experts of width 64, groups of 16)."""
    hf = make_synthetic("mixtral", tmp_path / "hf", seed=1)
    base = convert(hf, tmp_path / "base", dtype="bfloat16")
    tokens = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(9))
    stats = our_stats(base, tokens, tmp_path / "stats", awq_group_size=G)
    ep2 = convert(hf, tmp_path / "base_ep2", tp=2, moe_ep=2, moe_tp=1, dtype="bfloat16")
    quant = {
        name: our_quant(b, base, stats, tmp_path / f"awq_{name}", "int4_awq", group_size=G)
        for name, b in (("tp1", base), ("ep2", ep2))
    }
    t = _moe_tensors(quant["ep2"] / "rank1.safetensors", 0)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items() if not k.startswith("router")} == {
        "fc.weight": (torch.int8, (2, 64, 64)),
        "fc.weights_scaling_factor": (torch.float32, (2, 128, 64 // G)),
        "fc.prequant_scaling_factor": (torch.bfloat16, (64,)),
        "proj.weight": (torch.int8, (2, 32, 64)),
        "proj.weights_scaling_factor": (torch.float32, (2, 64, 64 // G)),
        "proj.prequant_scaling_factor": (torch.bfloat16, (64,)),
    }
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(5))
    _assert_twin_is_the_fake_quant_model(hf, base, quant, ids)


def test_a_stacked_pre_quant_scale_is_read_as_the_builder_reads_it(case, tmp_path):
    """ModelOpt stacks the shared pre-quant scale [E, in]; trtllm-build keeps row 0 for every expert. The twin does
    too: a checkpoint with the scale stacked (row 0 ours, the other rows anything) is the same model as ours."""
    src = case["quant"]["tp1"]
    out = tmp_path / "stacked"
    shutil.copytree(src, out)
    t = load_file(str(src / "rank0.safetensors"))
    for i in range(LAYERS):
        for lin in ("fc", "proj"):
            k = f"transformer.layers.{i}.mlp.{lin}.prequant_scaling_factor"
            noise = torch.rand(EXPERTS - 1, t[k].numel(), generator=torch.Generator().manual_seed(i)) + 0.5
            t[k] = torch.cat([t[k][None], noise.to(t[k].dtype)])
    save_file(t, str(out / "rank0.safetensors"))
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(out)(ids), load_checkpoint(src)(ids))


SMALL = (
    Path(__file__).resolve().parents[2] / "recipes" / "qwen3-30b-a3b-fp8.yaml"
)  # Qwen3-30B-A3B's published config: hidden 2048, expert width 768
ENGINE = ("--set", "target=engine", "--set", "engine.kv_cache.enable_reuse=false")


def _validate(*sets: str):
    args = ["validate", str(SMALL), *ENGINE, *[a for s in sets for a in ("--set", s)]]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_validate_takes_int4_awq_experts_on_the_engine_and_names_a_misaligned_linear():
    for algo in ("int4_awq", "int4_wo", "fp8"):
        result = _validate(f"quantization.algo={algo}")
        assert result.exit_code == 0, (algo, result.stderr)
    # moe_tp 8: down_proj's K is 768 / 8 = 96 per rank, not whole groups of 128
    result = _validate("quantization.algo=int4_awq", "parallel.tp=8")
    assert result.exit_code == 2
    assert (
        "quantization.group_size: int4_awq at tp=8: mlp.proj in_features 96 per rank is not a multiple of "
        "group_size 128; fix: a moe_tp that leaves mlp.proj whole groups and even rows per rank (more "
        "parallel.moe_ep), or fp8" in result.stderr
    ), result.stderr  # 32 would split 96, but the GEMM runs 64 / 128
    assert (
        "group-wise INT4 GEMM runs group_size 64 or 128 only"
        in _validate("quantization.algo=int4_awq", "quantization.group_size=32").stderr
    )
    assert (
        _validate("quantization.algo=int4_awq", "parallel.tp=8", "parallel.moe_ep=8", "parallel.moe_tp=1").exit_code
        == 0
    )  # whole experts per rank


def test_validate_keeps_refusing_w4a8_experts_and_excludes_that_split_a_moe_layer():
    result = _validate("quantization.algo=w4a8_awq")
    assert result.exit_code == 2
    assert (
        "quantization.algo: w4a8_awq for mixture-of-experts models is written only for target: llmapi "
        "(TensorRT-LLM 1.2's MoE layer takes W4A8 experts' group scales interleaved with a per-expert alpha"
        in result.stderr
        and "set target: llmapi, or use int4_awq or fp8" in result.stderr
    ), result.stderr
    result = _validate("quantization.algo=int4_awq", 'quantization.exclude=["*lm_head", "*mlp.proj"]')
    assert result.exit_code == 2
    assert (
        "quantization.exclude: the patterns exclude transformer.layers.0.mlp.proj ('*mlp.proj') but not "
        "transformer.layers.0.mlp, transformer.layers.0.mlp.fc: TensorRT-LLM quantizes a mixture-of-experts "
        "layer as one module" in result.stderr
    ), result.stderr
    # the whole MoE layer (module and both expert linears) unquantized: what the builder and the writer both do
    assert _validate("quantization.algo=int4_awq", 'quantization.exclude=["*lm_head", "*mlp*"]').exit_code == 0


def test_an_excluded_moe_layer_is_written_unquantized_whole(case):
    """``*mlp*`` (the MoE module and both expert linears, which validate accepts): the experts stay bf16, the
    pattern is in exclude_modules (so TensorRT-LLM rebuilds the MoE layer unquantized), attention stays int4."""
    out = our_quant(
        case["base"],
        case["base"],
        case["stats"],
        case["root"] / "awq_experts_excluded",
        "int4_awq",
        group_size=G,
        exclude=("*lm_head", "*mlp*"),
    )
    t = load_file(str(out / "rank0.safetensors"))
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for i in range(LAYERS):
        p = f"transformer.layers.{i}."
        assert {k for k in t if k.startswith(p + "mlp.")} == {
            p + "mlp.router.weight",
            p + "mlp.fc.weight",
            p + "mlp.proj.weight",
        }
        for lin in ("fc", "proj"):
            assert torch.equal(t[f"{p}mlp.{lin}.weight"], src[f"{p}mlp.{lin}.weight"])
        assert t[p + "attention.qkv.weight"].dtype == torch.int8
    assert "*mlp*" in json.loads((out / "config.json").read_text())["quantization"]["exclude_modules"]
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert bool(torch.isfinite(load_checkpoint(out)(ids)).all())
