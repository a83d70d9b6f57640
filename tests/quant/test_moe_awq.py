"""INT4 AWQ on a mixture-of-experts model (synthetic Qwen3-MoE, Qwen3-30B-A3B's ratios): each expert's AWQ search
runs on the tokens the router sent to it, the layer's experts share the mean pre-quant scale (ModelOpt 0.47's
``preprocess_linear_fusion(experts, resmooth_only=True)``), and the unified HF export writes every expert's
gate/up/down as a W4A16_AWQ linear of its own. Oracle: ModelOpt 0.47's own packing (``to_quantized_weight``) and
max-abs group scale (``get_scaling_factor_from_weight``) on the same float32 weights, expert by expert (its whole
AWQ export stops on transformers 5's fused experts, ``QuantQwen3MoeExperts`` has no ``len()``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from numerics import assert_same_model
from quant_helpers import our_quant, our_stats
from trtpipe.checkpoint.convert import convert
from trtpipe.checkpoint.quant_primitives import observe_amax, unpack_int4_rows
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
# The dense suite's bound per linear, 0.12 (tests/quant/test_modes.py), holds with margin. A token's path crosses 8
# quantized linears (qkv, o, gate_up, down in each of 2 layers) whose errors are independent: the logits' relative
# error is within sqrt(8) x 0.12 = 0.34, and KL(p_ref || p_q) ~ 1/2 Var_p(delta) <= 1/2 E[delta^2] for a logit
# perturbation delta (second-order expansion).
MAX_W_ERR, MAX_LOGIT_ERR = 0.12, 8 ** 0.5 * 0.12


def _export(base, hf, stats, out):
    out.mkdir()
    export_unified(base, hf, stats, out, algo="int4_awq", kv_cache="none", group_size=G, alpha=0.5,
                   exclude=["*lm_head"])
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_awq")
    hf = make_synthetic("qwen3_moe", root / "hf", seed=2)
    base = convert(hf, root / "base", tp=1, dtype="bfloat16")
    tokens = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(9))
    stats = our_stats(base, tokens, root / "stats", awq_group_size=G)
    idle_stats = our_stats(base, tokens[:1, :2], root / "idle_stats", awq_group_size=G)  # 2 tokens, top-2 of 8
    return dict(hf=hf, base=base, root=root, stats=stats, idle_stats=idle_stats,
                export=_export(base, hf, stats, root / "hf_awq"), idle=_export(base, hf, idle_stats, root / "hf_idle"))


def test_unified_layout_as_modelopt_writes_w4a16_awq_experts(case):
    t = load_file(str(case["export"] / "model.safetensors"))
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        assert t[pre + "mlp.gate.weight"].dtype == torch.bfloat16  # the router, unquantized
        assert t[pre + "self_attn.q_norm.weight"].dtype == torch.bfloat16
        for e in range(EXPERTS):
            for p, (out_f, in_f) in zip(PROJ, ((WIDTH, HIDDEN), (WIDTH, HIDDEN), (HIDDEN, WIDTH))):
                m = f"{pre}mlp.experts.{e}.{p}."
                got = {k[len(m):]: (v.dtype, tuple(v.shape)) for k, v in t.items() if k.startswith(m)}
                assert got == {"weight": (torch.uint8, (out_f // 2, in_f)),
                               "weight_scale": (torch.float32, (out_f, in_f // G)),
                               "pre_quant_scale": (torch.bfloat16, (in_f,))}, m
            # gate and up read one input: one pre-quant scale, and the layer's experts share it (ModelOpt's mean)
            e0 = f"{pre}mlp.experts.0."
            for p in PROJ:
                assert torch.equal(t[f"{pre}mlp.experts.{e}.{p}.pre_quant_scale"], t[f"{e0}{p}.pre_quant_scale"])
            assert torch.equal(t[f"{e0}gate_proj.pre_quant_scale"], t[f"{e0}up_proj.pre_quant_scale"])
        pqs = t[f"{pre}mlp.experts.0.up_proj.pre_quant_scale"].float()
        assert bool(torch.isfinite(pqs).all()) and bool((pqs > 0).all()) and not bool((pqs == 1).all())
    hq = json.loads((case["export"] / "hf_quant_config.json").read_text())["quantization"]
    assert (hq["quant_algo"], hq["group_size"], hq["has_zero_point"], hq["pre_quant_scale"]) == \
        ("W4A16_AWQ", G, False, True)
    assert {f"model.layers.{i}.mlp.gate" for i in range(LAYERS)} <= set(hq["exclude_modules"])
    assert "lm_head" in hq["exclude_modules"]
    inline = json.loads((case["export"] / "config.json").read_text())["quantization_config"]
    assert (inline["quant_algo"], inline["quant_method"]) == ("W4A16_AWQ", "modelopt")


def _expert_weights(src, i, e):
    """Each projection's weight as the bf16 checkpoint both exports are made from (``src``) holds it, fc = [up; gate]."""
    up, gate = src[f"transformer.layers.{i}.mlp.fc.weight"][e].float().chunk(2)
    return {"up_proj": up, "gate_proj": gate, "down_proj": src[f"transformer.layers.{i}.mlp.proj.weight"][e].float()}


@pytest.mark.oracle
def test_codes_and_idle_scales_byte_identical_to_modelopt(case):
    """ModelOpt's ``to_quantized_weight(W / pqs, weight_scale, "int4_awq", block_size=G)`` packs every expert
    projection into exactly our bytes (both exports), and for an expert no calibration token reached ModelOpt's
    ``get_scaling_factor_from_weight(W / pqs, G)`` (plain max-abs / 7) is exactly our weight_scale. W / pqs in float32
    with the stored bf16 pre-quant scale, the weight both sides quantize."""
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    idle_ids = (load_layer_stats(case["idle_stats"], 0).groups["mlp.fc+gate"].expert_amax == 0).nonzero().flatten()
    checked = idle_checked = 0
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for which in ("export", "idle"):
        t = load_file(str(case[which] / "model.safetensors"))
        for e in range(EXPERTS):
            w = _expert_weights(src, 0, e)
            for p in PROJ:
                m = f"model.layers.0.mlp.experts.{e}.{p}."
                wq = w[p] / t[m + "pre_quant_scale"].float()
                theirs = quant_utils.to_quantized_weight(wq, t[m + "weight_scale"], "int4_awq", None, G)
                assert torch.equal(theirs.view(torch.uint8), t[m + "weight"]), m
                checked += 1
                if which == "idle" and e in idle_ids.tolist():
                    assert torch.equal(quant_utils.get_scaling_factor_from_weight(wq, G), t[m + "weight_scale"]), m
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
    """Reference runtime on the unified export (experts dequantized exactly: codes x group scale, input x pre-quant
    scale) and on the TRT-LLM checkpoint the accuracy gate reads, against the unquantized bf16 model."""
    ids = torch.randint(3, 250, (4, 24), generator=torch.Generator().manual_seed(5))
    ref = load_checkpoint(case["base"])(ids).double()
    quant = our_quant(case["base"], case["base"], case["stats"], case["root"] / "trt_awq", "int4_awq", group_size=G)
    for name, model in (("unified", load_hf_checkpoint(case["export"])), ("trtllm", load_checkpoint(quant))):
        got = model(ids).double()
        rel = ((got - ref).norm() / ref.norm()).item()
        lr, lq = F.log_softmax(ref, -1), F.log_softmax(got, -1)
        kl = (lr.exp() * (lr - lq)).sum(-1).mean().item()
        centred = ref - ref.mean(-1, keepdim=True)
        kl_bound = 0.5 * (MAX_LOGIT_ERR * centred.norm() / centred.numel() ** 0.5).item() ** 2
        nll = [-(lp[:, :-1].gather(-1, ids[:, 1:, None])).mean().item() for lp in (lr, lq)]
        print(name, dict(rel=rel, kl=kl, kl_bound=kl_bound, ppl_ref=float(torch.tensor(nll[0]).exp()),
                         ppl_q=float(torch.tensor(nll[1]).exp())))
        assert 0 < rel < MAX_LOGIT_ERR and 0 < kl < kl_bound, (name, rel, kl, kl_bound)
    deq = load_file(str(quant / "rank0.safetensors"))
    src = load_file(str(case["base"] / "rank0.safetensors"))
    for lin in ("mlp.fc", "mlp.proj"):
        n = f"transformer.layers.1.{lin}"
        q = deq[f"{n}.weight"]
        w = torch.stack([unpack_int4_rows(q[e]).float() for e in range(EXPERTS)])
        w = w * deq[f"{n}.weights_scaling_factor"].repeat_interleave(G, -1) * deq[f"{n}.prequant_scaling_factor"].float()
        ref_w = src[f"{n}.weight"].float()
        assert ((w - ref_w).norm() / ref_w.norm()).item() < MAX_W_ERR, lin


@pytest.mark.parametrize("layout", ["ep2", "mtp2"])
def test_experts_split_by_moe_ep_and_moe_tp_are_the_same_model(case, layout):
    kw = dict(moe_ep=2, moe_tp=1) if layout == "ep2" else dict(moe_ep=1, moe_tp=2)
    base = convert(case["hf"], case["root"] / f"base_{layout}", tp=2, dtype="bfloat16", **kw)
    one = our_quant(case["base"], case["base"], case["stats"], case["root"] / f"tp1_{layout}", "int4_awq", group_size=G)
    two = our_quant(base, case["base"], case["stats"], case["root"] / f"awq_{layout}", "int4_awq", group_size=G)
    r = load_file(str(two / "rank1.safetensors"))
    e_r, w_r = (4, WIDTH) if layout == "ep2" else (8, WIDTH // 2)
    p = "transformer.layers.1.mlp."
    assert {k: (v.dtype, tuple(v.shape)) for k, v in r.items() if k.startswith(p) and "router" not in k} == {
        p + "fc.weight": (torch.int8, (e_r, w_r, HIDDEN)),
        p + "fc.weights_scaling_factor": (torch.float32, (e_r, 2 * w_r, HIDDEN // G)),
        p + "fc.prequant_scaling_factor": (torch.bfloat16, (HIDDEN,)),
        p + "proj.weight": (torch.int8, (e_r, HIDDEN // 2, w_r)),
        p + "proj.weights_scaling_factor": (torch.float32, (e_r, HIDDEN, w_r // G)),
        p + "proj.prequant_scaling_factor": (torch.bfloat16, (w_r,))}
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(4))
    assert_same_model(load_checkpoint(two), load_checkpoint(one), ids, layout)
