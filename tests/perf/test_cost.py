"""The cost model's terms on small cases computed by hand (exact arithmetic, float64 reference)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trtpipe.formats.gpus import GPU, get_gpu
from trtpipe.errors import TrtpipeError
from trtpipe.perf.cost import Constants, Deployment, Terms, bound, experts_touched, group_terms, step_terms, step_time
from trtpipe.perf.models import PUBLISHED, LayerKind, ModelSpec, published_spec, spec_of

# 1 TB/s, 1 TFLOPS (16-bit), 2 TFLOPS (FP8), 100 GB/s link: seconds come out as simple fractions
GPU_T = GPU("toy", "Toy", 1024, 90, 1000, tflops_16=1, tflops_fp8=2, link_gbs=100, nvlink=True)


def toy(experts=0, top_k=0, window=0, layers=2) -> ModelSpec:
    # hidden 8, 2 heads of 4, 1 KV head: attention = 8*(2+2)*4 + 2*4*8 = 192 params; MLP 3*8*16 = 384
    kind = LayerKind(layers, 192, 0 if experts else 384, experts, top_k, 384 if experts else 0, window)
    return ModelSpec("toy", hidden=8, vocab=10, heads=2, kv_heads=1, qk_dim=4, v_dim=4, kv_elems=8, layers=(kind,))


def test_dense_decode_step_terms_by_hand():
    d = Deployment(toy(), GPU_T, "fp16", "fp16")
    t = step_terms(d, context=[], generation=[3, 5])  # two generating requests with 3 and 5 cached tokens
    bw, flops16 = 1e12, 1e12
    weights = 2 * (192 + 384) * 2  # two layers, 16-bit
    assert t.mem == pytest.approx((weights + 10 * 8 * 2) / bw, rel=1e-12)  # + lm_head 10x8 16-bit
    kv_tokens = (3 + 1) + (5 + 1)  # each attends over its cache plus the new token
    assert t.kv == pytest.approx(2 * kv_tokens * 8 * 2 / bw, rel=1e-12)  # 8 elements x 2 bytes per token-layer
    assert t.gemm == pytest.approx((2 * 2 * 2 * 576 + 2 * 2 * 80) / flops16, rel=1e-12)
    assert t.attn == pytest.approx(2 * 2 * 2 * (4 + 4) * kv_tokens / flops16, rel=1e-12)
    assert t.comm == 0 and t.layers == 2 and t.seqs == 2


def test_context_pairs_are_causal_and_fp8_uses_the_fp8_peak():
    d = Deployment(toy(layers=1), GPU_T, "fp8", "fp8")
    t = step_terms(d, context=[(2, 3)])  # 3 new tokens after 2 cached: 3*2 + 3*4/2 = 12 pairs
    assert t.attn == pytest.approx(2 * 2 * 8 * 12 / 1e12, rel=1e-12)
    assert t.gemm == pytest.approx(2 * 3 * 576 / 2e12 + 2 * 1 * 80 / 1e12, rel=1e-12)  # one sampled row
    assert t.mem == pytest.approx((576 * 1 + 160) / 1e12, rel=1e-12)  # FP8 linears, 16-bit lm_head


def test_tensor_parallel_all_reduce_and_kv_head_replication():
    d = Deployment(toy(layers=1), GPU_T, "fp16", "fp16", tp=2)
    t = step_terms(d, generation=[0, 0, 0, 0])
    # two ring all-reduces per layer of tokens x hidden x 2 bytes, each moving 2 (tp-1)/tp of it
    assert t.comm == pytest.approx(2 * 2 * (1 / 2) * 4 * 8 * 2 / 100e9, rel=1e-12)
    # one KV head cannot be split: each of the two ranks stores it whole
    assert d.kv_bytes_per_token == 1 * 8 * 2
    assert t.mem == pytest.approx((576 / 2 * 2 + 80 / 2 * 2) / 1e12, rel=1e-12)


def test_attention_dp_moe_gathers_every_token_once_whatever_its_top_k():
    """Under attention DP the PyTorch backend's CUTLASS MoE all-gathers all ranks' tokens before the experts and
    reduce-scatters their output (fused_moe_cutlass.py@000a01de): one hidden vector each way per token, so the link
    time does not grow with top-k, and expert parallelism and MoE-TP move the same bytes."""
    gen = [0] * 8  # 8 generating tokens over 4 attention-DP ranks
    link = lambda k, ep: (  # noqa: E731
        step_terms(
            Deployment(toy(experts=4, top_k=k, layers=1), GPU_T, "fp16", "fp16", tp=4, ep=ep, attn_dp=True),
            generation=gen,
        ).comm
    )
    expected = 2 * 8 * 8 * 2 * (3 / 4) / 100e9  # gather + scatter of 8 tokens x hidden 8 x 2 bytes, 3/4 off-rank
    assert link(1, 4) == pytest.approx(expected, rel=1e-12)
    assert link(2, 4) == pytest.approx(expected, rel=1e-12)  # top-2: the same bytes (not one crossing per copy)
    assert link(2, 1) == pytest.approx(expected, rel=1e-12)  # MoE-TP (every rank a slice of every expert): same


def test_attention_dp_keeps_a_whole_embedding_and_lm_head_on_every_rank():
    """Under attention DP every rank samples its own requests against a whole lm_head (TRT-LLM builds ``LMHead``
    without a mapping then, and the embedding likewise): its 16-bit bytes count whole per GPU and per step; the
    lm_head FLOPs stay the sampled rows x the whole head, spread over the ranks."""
    spec = toy(experts=4, top_k=1, layers=1)
    tp = Deployment(spec, GPU_T, "fp16", "fp16", tp=2, ep=2)
    dp = Deployment(spec, GPU_T, "fp16", "fp16", tp=2, ep=2, attn_dp=True)
    head = 10 * 8 * 2  # vocab x hidden x 2 bytes
    assert dp.weight_bytes_per_gpu - tp.weight_bytes_per_gpu == pytest.approx(
        2 * head / 2 + (192 + 0) * 2 / 2, rel=1e-12
    )  # embedding + lm_head halves, and the replicated attention
    t_tp, t_dp = step_terms(tp, generation=[0, 0]), step_terms(dp, generation=[0, 0])
    assert t_dp.mem - t_tp.mem == pytest.approx((head / 2 + 192 * 2 / 2) / 1e12, rel=1e-9)
    assert t_dp.gemm == pytest.approx(t_tp.gemm, rel=1e-12)


def test_profiling_activation_bytes_by_hand():
    """The pass the PyTorch backend runs before sizing its KV pool: the largest layer's 16-bit buffers for
    max_num_tokens tokens; an MoE layer adds its fused-MoE rows for every attention-DP rank's tokens x top-k."""
    dense = Deployment(toy(layers=1), GPU_T, "fp16", "fp16")
    assert dense.profiling_activation_bytes(0) == 0
    # 3 hidden vectors + (192 + 384) / 8 linear outputs per token
    assert dense.profiling_activation_bytes(100) == pytest.approx(100 * (3 * 8 + 576 / 8) * 2, rel=1e-12)
    moe = Deployment(toy(experts=4, top_k=2, layers=1), GPU_T, "fp16", "fp16", tp=2, ep=2, attn_dp=True)
    inter = 384 / (3 * 8)  # one expert's intermediate width (ep = tp: whole experts)
    want = 100 * (3 * 8 + 192 / 8) + 100 * 2 * 2 * (2 * 8 + 3 * inter)  # 2 ranks' tokens x top-2 rows
    assert moe.profiling_activation_bytes(100) == pytest.approx(want * 2, rel=1e-12)


def test_moe_reads_only_the_experts_tokens_hit():
    assert experts_touched(8, 2, 1) == pytest.approx(2.0)
    assert experts_touched(8, 2, 2) == pytest.approx(8 * (1 - (6 / 8) ** 2))
    d = Deployment(toy(experts=4, top_k=1, layers=1), GPU_T, "fp16", "fp16")
    t1 = step_terms(d, generation=[0])
    assert t1.mem == pytest.approx((192 + 384 + 80) * 2 / 1e12, rel=1e-12)  # attention + one expert + head
    big = step_terms(d, generation=[0] * 1000)
    assert big.mem == pytest.approx((192 + 4 * 384 * (1 - 0.75**1000) + 80) * 2 / 1e12, rel=1e-9)
    assert big.gemm == pytest.approx((2 * 1000 * (192 + 384) + 2 * 1000 * 80) / 1e12, rel=1e-12)


def test_sliding_window_caps_kv_reads():
    d = Deployment(toy(window=4, layers=1), GPU_T, "fp16", "fp16")
    assert step_terms(d, generation=[100]).kv == pytest.approx(4 * 8 * 2 / 1e12, rel=1e-12)


def test_chunked_attention_reads_only_the_current_chunk():
    kind = LayerKind(1, 192, 384, chunk=4)
    spec = ModelSpec("toy", hidden=8, vocab=10, heads=2, kv_heads=1, qk_dim=4, v_dim=4, kv_elems=8, layers=(kind,))
    d = Deployment(spec, GPU_T, "fp16", "fp16")
    # a token at position 9 (9 cached) is the 2nd of chunk [8, 12): it reads 2 KV tokens, not 10
    assert step_terms(d, generation=[9]).kv == pytest.approx(2 * 8 * 2 / 1e12, rel=1e-12)
    # a 6-token prompt from position 2: positions 2, 3 | 4..7 see 3, 4 | 1, 2, 3, 4 keys = 17 pairs (causal: 33)
    assert step_terms(d, context=[(2, 6)]).attn == pytest.approx(2 * 2 * 8 * 17 / 1e12, rel=1e-12)


def test_expert_gemms_and_routed_copies_have_their_own_terms():
    d = Deployment(toy(experts=4, top_k=2, layers=2), GPU_T, "fp16", "fp16", tp=2, ep=2)
    t = step_terms(d, generation=[0] * 10)
    # 10 tokens x top-2 x 384 params x 2 FLOPs per layer, spread over the 2 ranks; 10 x 2 / 2 copies per layer
    assert t.expert_gemm == pytest.approx(2 * 2 * 10 * 2 * 384 / 2 / 1e12, rel=1e-12)
    assert t.copies == pytest.approx(2 * 10 * 2 / 2, rel=1e-12)
    c = Constants(
        gemm_eff=0.5,
        attn_eff=1.0,
        serial=1.0,
        layer_us=0.0,
        seq_layer_us=0.0,
        link_eff=1.0,
        bw_eff=1.0,
        kv_eff=1.0,
        copy_ns=100.0,
    )
    base = step_time(t, c)
    # expert_eff 0 (the engine era): experts at the dense rate; else their share of the GEMM seconds at its own
    slow = step_time(t, Constants(**{**c.__dict__, "expert_eff": 0.25}))
    assert slow - base == pytest.approx(t.expert_gemm / 0.25 - t.expert_gemm / 0.5, rel=1e-9)
    no_copies = step_time(t, Constants(**{**c.__dict__, "copy_ns": 0.0}))
    assert base - no_copies == pytest.approx(t.copies * 100e-9, rel=1e-9)


def test_pipeline_stage_holds_ceil_layers():
    d = Deployment(toy(layers=3), GPU_T, "fp16", "fp16", pp=2)
    t = step_terms(d, generation=[0])
    assert t.layers == 2 and t.pp == 2
    assert t.comm == pytest.approx(1 * 8 * 2 / 100e9, rel=1e-12)  # hidden state to the next stage


def test_grouped_terms_equal_the_per_entry_terms():
    d = Deployment(published_spec("Mixtral 8x7B"), get_gpu("h100"), "fp8", "fp8", tp=2)
    a = step_terms(d, context=[(0, 100), (0, 100)], generation=[7, 7, 9])
    b = group_terms(d, [(0, 100, 2.0)], [(7, 2.0), (9, 1.0)], 5)
    for name in ("mem", "kv", "gemm", "attn", "comm", "seqs"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12)


def test_step_time_formula_and_bound():
    t = Terms(mem=1.0, kv=0.5, gemm=0.3, attn=0.1, comm=0.2, seqs=10, layers=4, pp=2)
    c = Constants(
        bw_eff=0.5,
        kv_eff=0.25,
        gemm_eff=0.5,
        attn_eff=0.5,
        link_eff=0.5,
        seq_layer_us=100,
        serial=0.5,
        layer_us=1000,
        pp_bubble=0.5,
    )
    memory, compute = 1.0 / 0.5 + 0.5 / 0.25, 0.3 / 0.5 + 0.1 / 0.5
    body = memory + 0.5 * compute + 0.2 / 0.5 + 4 * 1e-3 + 10 * 4 * 1e-4
    assert step_time(t, c) == pytest.approx(body * 1.5, rel=1e-12)
    assert bound(t, c) == "bandwidth"
    arr = Terms(*(np.array([v, v]) for v in (1.0, 0.5, 0.3, 0.1, 0.2, 10, 4)), pp=np.array([2, 2]))
    assert np.allclose(step_time(arr, c), step_time(t, c))


def test_gemm_time_grows_with_the_precisions_peak():
    # the same GEMM seconds-at-peak take (1 + flop_drop x PFLOPS) / gemm_eff: B200 FP4 (9 PFLOPS) reaches a
    # smaller fraction of its peak than H100 FP8 (1.98 PFLOPS); flop_drop 0 (the engine era) is the plain roofline
    c = Constants(gemm_eff=0.5, attn_eff=1.0, serial=1.0, layer_us=0.0, seq_layer_us=0.0, flop_drop=0.1)
    one = lambda pf, cc=c: step_time(  # noqa: E731
        Terms(
            mem=0,
            kv=0,
            gemm=1.0,
            attn=0,
            comm=0,
            seqs=0,
            layers=1,
            peak_pf=pf,
        ),
        cc,
    )
    assert one(9.0) == pytest.approx(1.0 / 0.5 * 1.9, rel=1e-12)
    assert one(0.0) == pytest.approx(2.0, rel=1e-12)
    assert one(9.0, Constants(gemm_eff=0.5, layer_us=0.0, seq_layer_us=0.0)) == pytest.approx(2.0, rel=1e-12)
    b200 = Deployment(published_spec("Llama 3.1 8B"), get_gpu("b200"), "fp4", "fp8")
    h100 = Deployment(published_spec("Llama 3.1 8B"), get_gpu("h100"), "fp8", "fp8")
    assert step_terms(b200, generation=[10]).peak_pf == pytest.approx(9.0)
    assert step_terms(h100, generation=[10]).peak_pf == pytest.approx(1.979)


def test_published_models_match_their_parameter_counts():
    # totals as the model cards state them (billions), within 3%
    for name, billions in (
        ("Llama 3.1 70B", 70.6),
        ("Llama 3.1 8B", 8.03),
        ("Mixtral 8x7B", 46.7),
        ("Llama 3.1 405B", 405.8),
        ("Qwen3-235B-A22B", 235),
        ("DeepSeek R1 0528", 671),
        ("Llama 4 Maverick 17B-128E", 400),
        ("Falcon 180B", 180),
        ("GPT-OSS 120B", 117),
    ):
        assert published_spec(name).total_params / 1e9 == pytest.approx(billions, rel=0.03), name
    assert published_spec("Qwen3-30B-A3B").active_params / 1e9 == pytest.approx(3.3, rel=0.05)
    assert len(PUBLISHED) == 21


def test_errors_name_the_missing_thing():
    with pytest.raises(TrtpipeError, match="model_type 'bert'"):
        spec_of({"model_type": "bert"})
    with pytest.raises(TrtpipeError, match="'hidden_size' is missing"):
        spec_of({"model_type": "llama"})
    with pytest.raises(TrtpipeError, match="tflops_fp4"):
        Deployment(toy(), get_gpu("h100"), "fp4", "fp8")
    assert math.isfinite(Deployment(toy(), get_gpu("h100"), "fp8", "fp8").gemm_peak)
