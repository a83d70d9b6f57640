"""W4A8 AWQ on a mixture-of-experts model (synthetic Qwen3-MoE, Qwen3-30B-A3B's ratios): each expert's AWQ search
runs on the tokens the router sent to it, the layer's experts share the mean pre-quant scale (ModelOpt 0.47's
``preprocess_linear_fusion(experts, resmooth_only=True)``), and the unified HF export writes every expert's
gate/up/down as a W4A8_AWQ linear of its own, as TensorRT-LLM's fused MoE (``WInt4AFP8FusedMoEMethod``) reads them:
per-group ``weight_scale``, per-expert ``weight_scale_2`` and ``input_scale`` (from the tokens routed to it), the
shared ``pre_quant_scale``. Oracle: ModelOpt 0.47's own packing (``to_quantized_weight``), max-abs group scale
(``get_scaling_factor_from_weight``) and per-tensor FP8 scale (``get_scaling_factor`` of an FP8 quantizer holding
the amax) on the same float32 weights and amax, expert by expert (its whole AWQ export stops on transformers 5's
fused experts, ``QuantQwen3MoeExperts`` has no ``len()``). The shapes are small (K 64 and 32, groups of 16): the
export writes any even/grouped shape; the K-multiple-of-128 rule of TensorRT-LLM's kernels is validate's
(tests/recipe/test_qwen3_moe_recipes.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from numerics import assert_same_model
from quant_helpers import our_quant, our_stats, synthetic_moe_case
from trtpipe.checkpoint.convert import convert
from trtpipe.formats.primitives import observe_amax, unpack_int4_rows
from trtpipe.export.unified import export_unified
from trtpipe.models.synthetic import make_synthetic
from trtpipe.quant.awq import expert_awq
from trtpipe.quant.calibrate import load_layer_stats
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint

G, LAYERS, EXPERTS, HIDDEN, WIDTH = 16, 2, 8, 64, 32  # group 16: moe_tp 2 leaves 16 input features of down_proj
PROJ = ("gate_proj", "up_proj", "down_proj")
# INT4 round-to-nearest on groups of 16: the error is uniform in +-amax/14, rms amax/(7 sqrt 12) ~ 0.041 amax, and a
# group's amax is ~2 standard deviations of its weights (the clip search only lowers it): ~0.08 relative per weight.
# FP8 inputs (E4M3, 3 mantissa bits) add a relative rounding error of at most 2^-4 per element, rms 2^-4/sqrt(3)
# ~ 0.036, independent of the weight's: sqrt(0.08^2 + 0.036^2) ~ 0.09 per linear. The dense suite's bound per
# W4A8 linear, 0.12 (tests/quant/test_modes.py), holds with margin. A token's path crosses 8
# quantized linears (qkv, o, gate_up, down in each of 2 layers) whose errors are independent: the logits' relative
# error is within sqrt(8) x 0.12 = 0.34, and KL(p_ref || p_q) ~ 1/2 Var_p(delta) <= 1/2 E[delta^2] for a logit
# perturbation delta (second-order expansion).
MAX_W_ERR, MAX_LOGIT_ERR = 0.12, 8**0.5 * 0.12


def _export(base, hf, stats, out):
    out.mkdir()
    export_unified(
        base, hf, stats, out, algo="w4a8_awq", kv_cache="none", group_size=G, alpha=0.5, exclude=["*lm_head"]
    )
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_awq")
    hf, base, tokens = synthetic_moe_case(root)
    stats = our_stats(base, tokens, root / "stats", awq_group_size=G)
    idle_stats = our_stats(base, tokens[:1, :2], root / "idle_stats", awq_group_size=G)  # 2 tokens, top-2 of 8
    return dict(
        hf=hf,
        base=base,
        root=root,
        stats=stats,
        idle_stats=idle_stats,
        export=_export(base, hf, stats, root / "hf_awq"),
        idle=_export(base, hf, idle_stats, root / "hf_idle"),
    )


def test_unified_layout_as_modelopt_writes_w4a8_awq_experts(case):
    t = load_file(str(case["export"] / "model.safetensors"))
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        assert t[pre + "mlp.gate.weight"].dtype == torch.bfloat16  # the router, unquantized
        assert t[pre + "self_attn.q_norm.weight"].dtype == torch.bfloat16
        for e in range(EXPERTS):
            for p, (out_f, in_f) in zip(PROJ, ((WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH))):
                m = f"{pre}mlp.experts.{e}.{p}."
                got = {k[len(m) :]: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(m)}
                assert got == {
                    "weight": (torch.uint8, (out_f // 2, in_f)),
                    "weight_scale": (torch.float32, (out_f, in_f // G)),
                    "weight_scale_2": (torch.float32, ()),
                    "input_scale": (torch.float32, ()),
                    "pre_quant_scale": (torch.bfloat16, (in_f,)),
                }, m
            # gate and up read one input: one pre-quant scale, and the layer's experts share it (ModelOpt's mean);
            # they are one GEMM: one weight_scale_2 and one input_scale per expert
            e0, me = f"{pre}mlp.experts.0.", f"{pre}mlp.experts.{e}."
            for p in PROJ:
                assert torch.equal(t[f"{me}{p}.pre_quant_scale"], t[f"{e0}{p}.pre_quant_scale"])
            for k in ("pre_quant_scale", "weight_scale_2", "input_scale"):
                assert torch.equal(t[f"{me}gate_proj.{k}"], t[f"{me}up_proj.{k}"]), (me, k)
        for p in PROJ:  # per expert: its own tokens, its own weights
            for k in ("weight_scale_2", "input_scale"):
                v = torch.stack([t[f"{pre}mlp.experts.{e}.{p}.{k}"] for e in range(EXPERTS)])
                assert bool((v > 0).all()) and bool(torch.isfinite(v).all()) and len(set(v.tolist())) > 1, (p, k)
        pqs = t[f"{pre}mlp.experts.0.up_proj.pre_quant_scale"].float()
        assert bool(torch.isfinite(pqs).all()) and bool((pqs > 0).all()) and not bool((pqs == 1).all())
    hq = json.loads((case["export"] / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["group_size"], hq["has_zero_point"], hq["pre_quant_scale"]) == (
        "W4A8_AWQ",
        G,
        False,
        True,
    )
    assert {f"model.layers.{i}.mlp.gate" for i in range(LAYERS)} <= set(hq["exclude_modules"])
    assert "lm_head" in hq["exclude_modules"]
    inline = json.loads((case["export"] / "config.json").read_text())["quantization_config"]
    assert (inline["quant_algo"], inline["quant_method"]) == ("W4A8_AWQ", "modelopt")


def _expert_weights(src, i, e):
    """Each projection's weight as the bf16 checkpoint both exports are made from (``src``) holds it, fc = [up; gate]."""
    up, gate = src[f"transformer.layers.{i}.mlp.fc.weight"][e].float().chunk(2)
    return {"up_proj": up, "gate_proj": gate, "down_proj": src[f"transformer.layers.{i}.mlp.proj.weight"][e].float()}


@pytest.mark.oracle
def test_codes_and_scales_identical_to_modelopt(case):
    """Per expert projection, ModelOpt 0.47's own functions on the same float32 ``W / pqs`` (stored bf16 pre-quant
    scale) and the same amax give our tensors: ``to_quantized_weight(W / pqs, weight_scale, "w4a8_awq",
    block_size=G)`` our packed bytes (both exports); ``get_scaling_factor`` of an FP8 (E4M3) quantizer holding
    max(amax(gate / pqs), amax(up / pqs)) (an expert's fused pair, down alone) our ``weight_scale_2``, and holding
    the amax of ``x * pqs`` over the tokens routed to the expert (calibration's per-channel amax times the scale, as
    ModelOpt's ``apply_pre_quant_scale_and_smooth`` forms it) our ``input_scale``; for an expert no calibration token
    reached, ``get_scaling_factor_from_weight(W / pqs, G)`` (plain max-abs / 7) our weight_scale and the whole MoE
    input's amax its input_scale. (ModelOpt's own flow would then keep that input amax in the weight dtype, bf16,
    half an ulp, 2^-9 relative, from ours; trtpipe keeps it in float32, as its dense export does.)"""
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    def fp8_scale(amax):
        q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
        q.amax = amax.float().reshape(())
        return quant_utils.get_scaling_factor(q).reshape(())

    checked = idle_checked = 0
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for which, stats in (("export", "stats"), ("idle", "idle_stats")):
        t = load_file(str(case[which] / "model.safetensors"))
        st = load_layer_stats(case[stats], 0).groups
        idle_ids = (st["mlp.fc+gate"].expert_amax == 0).nonzero().flatten().tolist()
        for e in range(EXPERTS):
            w = _expert_weights(src, 0, e)
            m = {p: f"model.layers.0.mlp.experts.{e}.{p}." for p in PROJ}
            wq = {p: w[p] / t[m[p] + "pre_quant_scale"].float() for p in PROJ}
            wamax = {
                "gate_proj": torch.maximum(wq["gate_proj"].abs().amax(), wq["up_proj"].abs().amax()),
                "down_proj": wq["down_proj"].abs().amax(),
            }
            wamax["up_proj"] = wamax["gate_proj"]
            for p, group in zip(PROJ, ("mlp.fc+gate", "mlp.fc+gate", "mlp.proj")):
                theirs = quant_utils.to_quantized_weight(wq[p], t[m[p] + "weight_scale"], "w4a8_awq", None, G)
                assert torch.equal(theirs.view(torch.uint8), t[m[p] + "weight"]), m[p]
                assert torch.equal(fp8_scale(wamax[p]), t[m[p] + "weight_scale_2"]), m[p]
                pqs, g = t[m[p] + "pre_quant_scale"].float(), st[group]
                x_amax = g.expert_channel_amax[e] if e not in idle_ids else g.amax
                assert torch.equal(t[m[p] + "input_scale"], fp8_scale((x_amax * pqs).amax())), m[p]
                checked += 1
                if e in idle_ids:
                    assert torch.equal(quant_utils.get_scaling_factor_from_weight(wq[p], G), t[m[p] + "weight_scale"])
                    idle_checked += 1
    assert checked == 2 * EXPERTS * 3 and idle_checked >= 3 * 4  # at most 4 of 8 experts saw one of the 2 tokens


def test_an_expert_no_calibration_token_reached_gets_max_abs_int4(case, caplog):
    """Fallback: an idle expert adds nothing to the layer's mean pre-quant scale, and its weights get plain per-group
    max-abs scales for that scale (``int4_wo`` rounding); with no expert calibrated at all the scale is 1."""
    with caplog.at_level(logging.WARNING, logger="trtpipe.quant"):
        our_stats(case["base"], torch.tensor([[5, 9]]), case["root"] / "idle_again", awq_group_size=G)
    assert any("no token reached expert(s)" in r.getMessage() and "max-abs" in r.getMessage() for r in caplog.records)
    g = load_layer_stats(case["idle_stats"], 0).groups["mlp.fc+gate"]
    idle = (g.expert_amax == 0).nonzero().flatten().tolist()
    assert idle
    t = load_file(str(case["idle"] / "model.safetensors"))
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for e in range(EXPERTS):
        w = _expert_weights(src, 0, e)
        for p in PROJ:
            m = f"model.layers.0.mlp.experts.{e}.{p}."
            ws, pqs = t[m + "weight_scale"], t[m + "pre_quant_scale"].float()
            assert bool(torch.isfinite(ws).all()) and bool((ws > 0).all()) and bool((pqs > 0).all())
            if e in idle:
                assert torch.equal(ws, observe_amax(w[p] / pqs, G) / 7), m
    ws = [torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=torch.Generator().manual_seed(1))]
    pqs, amax, none_seen = expert_awq([None] * EXPERTS, [None] * EXPERTS, ws, G)
    assert torch.equal(pqs, torch.ones(HIDDEN)) and none_seen == list(range(EXPERTS))
    assert all(torch.equal(a, observe_amax(ws[0][e], G)) for e, a in enumerate(amax))


def test_accuracy_against_the_unquantized_model(case):
    """Reference runtime on the unified export (experts dequantized as TensorRT-LLM's loader does: codes x group
    scale over weight_scale_2 rounded to 16 bits, x weight_scale_2; input x pre-quant scale, then FP8 with the
    expert's static input_scale) and on the TRT-LLM checkpoint the accuracy gate reads, against the unquantized bf16
    model."""
    ids = torch.randint(3, 250, (4, 24), generator=torch.Generator().manual_seed(5))
    ref = load_checkpoint(case["base"])(ids).double()
    quant = our_quant(case["base"], case["base"], case["stats"], case["root"] / "trt_awq", "w4a8_awq", group_size=G)
    for name, model in (("unified", load_hf_checkpoint(case["export"])), ("trtllm", load_checkpoint(quant))):
        got = model(ids).double()
        rel = ((got - ref).norm() / ref.norm()).item()
        lr, lq = F.log_softmax(ref, -1), F.log_softmax(got, -1)
        kl = (lr.exp() * (lr - lq)).sum(-1).mean().item()
        centred = ref - ref.mean(-1, keepdim=True)
        kl_bound = 0.5 * (MAX_LOGIT_ERR * centred.norm() / centred.numel() ** 0.5).item() ** 2
        nll = [-(lp[:, :-1].gather(-1, ids[:, 1:, None])).mean().item() for lp in (lr, lq)]
        print(
            name,
            dict(
                rel=rel,
                kl=kl,
                kl_bound=kl_bound,
                ppl_ref=float(torch.tensor(nll[0]).exp()),
                ppl_q=float(torch.tensor(nll[1]).exp()),
            ),
        )
        assert 0 < rel < MAX_LOGIT_ERR and 0 < kl < kl_bound, (name, rel, kl, kl_bound)
    deq = load_file(str(quant / "rank0.safetensors"))
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for lin in ("mlp.fc", "mlp.proj"):
        n = f"transformer.layers.1.{lin}"
        q = deq[f"{n}.weight"]
        w = torch.stack([unpack_int4_rows(q[e]).float() for e in range(EXPERTS)])  # the full group scales
        w = (
            w
            * deq[f"{n}.weights_scaling_factor"].repeat_interleave(G, -1)
            * deq[f"{n}.prequant_scaling_factor"].float()
        )
        ref_w = src[f"{n}.weight"].float()
        assert ((w - ref_w).norm() / ref_w.norm()).item() < MAX_W_ERR, lin


@pytest.mark.parametrize("layout", ["ep2", "mtp2"])
def test_experts_split_by_moe_ep_and_moe_tp_are_the_same_model(case, layout):
    kw = dict(moe_ep=2, moe_tp=1) if layout == "ep2" else dict(moe_ep=1, moe_tp=2)
    base = convert(case["hf"], case["root"] / f"base_{layout}", tp=2, dtype="bfloat16", **kw)
    one = our_quant(case["base"], case["base"], case["stats"], case["root"] / f"tp1_{layout}", "w4a8_awq", group_size=G)
    two = our_quant(base, case["base"], case["stats"], case["root"] / f"awq_{layout}", "w4a8_awq", group_size=G)
    r = load_file(str(two / "rank1.safetensors"))
    e_r, w_r = (4, WIDTH) if layout == "ep2" else (8, WIDTH // 2)
    p = "transformer.layers.1.mlp."
    assert {k: (v.dtype, tuple(v.shape)) for k, v in r.items() if k.startswith(p) and "router" not in k} == {
        p + "fc.weight": (torch.int8, (e_r, w_r, HIDDEN)),
        p + "fc.weights_scaling_factor": (torch.float32, (e_r, 2 * w_r, HIDDEN // G)),
        p + "fc.prequant_scaling_factor": (torch.bfloat16, (HIDDEN,)),
        p + "fc.weights_scaling_factor_2": (torch.float32, (e_r, 1)),
        p + "fc.activation_scaling_factor": (torch.float32, (e_r, 1)),
        p + "proj.weight": (torch.int8, (e_r, HIDDEN // 2, w_r)),
        p + "proj.weights_scaling_factor": (torch.float32, (e_r, HIDDEN, w_r // G)),
        p + "proj.prequant_scaling_factor": (torch.bfloat16, (w_r,)),
        p + "proj.weights_scaling_factor_2": (torch.float32, (e_r, 1)),
        p + "proj.activation_scaling_factor": (torch.float32, (e_r, 1)),
    }
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(4))
    assert_same_model(load_checkpoint(two), load_checkpoint(one), ids, layout)


def test_mixtral_experts_are_w4a8_linears_under_their_own_names(tmp_path):
    """Mixtral's experts (``block_sparse_moe.experts.{e}.w1/w3/w2``, the names TensorRT-LLM's fused MoE reads) get
    the same five W4A8 tensors, and the model stays within the accuracy bound above (2 layers, 8 quantized linears
    on a token's path, as for Qwen3-MoE)."""
    hf = make_synthetic("mixtral", tmp_path / "hf", seed=1)
    base = convert(hf, tmp_path / "base", tp=1, dtype="bfloat16")
    tokens = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(9))
    out = _export(base, hf, our_stats(base, tokens, tmp_path / "stats", awq_group_size=G), tmp_path / "out")
    t = load_file(str(out / "model.safetensors"))
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            m = f"model.layers.0.block_sparse_moe.experts.{e}.{w}."
            assert {k[len(m) :] for k in t if k.startswith(m)} == {
                "weight",
                "weight_scale",
                "weight_scale_2",
                "input_scale",
                "pre_quant_scale",
            }, m
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(5))
    ref = load_checkpoint(base)(ids).double()
    rel = ((load_hf_checkpoint(out)(ids).double() - ref).norm() / ref.norm()).item()
    assert 0 < rel < MAX_LOGIT_ERR, rel
