"""Conversion + reference runtime vs transformers (the oracle), float32, for every parallel layout."""

from __future__ import annotations

import pytest
import torch

from numerics import assert_as_accurate, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.runtime import generate, load_checkpoint

LAYOUTS = [  # (tp, pp, moe_ep)
    (1, 1, -1),
    (2, 1, -1),
    (4, 1, -1),
    (1, 2, -1),
    (2, 2, -1),
]
# MoE (Mixtral, Qwen3-MoE, gpt-oss): experts split into 2 contiguous blocks (ep=2, moe_tp=1), and ep=2 x moe_tp=2 at
# tp=4. gpt-oss (no engine: the runtime is its only CPU executor) at tp1, tp2 (moe_tp 2: each expert's rows split)
# and tp2 x pp2.
CASES = (
    [(m, *lay) for m in ("stories", "llama3", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma3") for lay in LAYOUTS]
    + [("gpt_oss", *lay) for lay in (LAYOUTS[0], LAYOUTS[1], LAYOUTS[4])]
    + [(m, tp, 1, 2) for m in ("mixtral", "qwen3_moe", "gpt_oss") for tp in (2, 4)]
)


# tp1 pp1 of every family is in the fast tier (make test-fast); the sweep over layouts is slow
PARAMS = [
    pytest.param(
        m,
        t,
        p,
        e,
        id=f"{m}-tp{t}-pp{p}" + (f"-ep{e}" if e > 0 else ""),
        marks=() if (t, p) == (1, 1) else pytest.mark.slow,
    )
    for m, t, p, e in CASES
]


@pytest.mark.parametrize("model,tp,pp,ep", PARAMS)
def test_logits_and_greedy_match_transformers(model, tp, pp, ep, hf_models, prompts, oracle, tmp_path):
    ckpt = convert(hf_models[model], tmp_path / "ckpt", tp=tp, pp=pp, moe_ep=ep, dtype="float32")
    ref = oracle(model)
    rt = load_checkpoint(ckpt)
    ref.assert_logits(rt(torch.tensor(prompts[model])), f"{model} tp{tp} pp{pp}")
    ref.assert_greedy(generate(rt, prompts[model][:2], 64, end_ids=ref.eos), f"{model} tp{tp} pp{pp}")


def test_stories_greedy_text(stories_dir, tmp_path):
    """The continuation SOURCE.md documents for the real model, through a tp=2 x pp=2 checkpoint."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    rt = load_checkpoint(convert(stories_dir, tmp_path / "ckpt", tp=2, pp=2, dtype="float32"))
    ids = tok("Once upon a time")["input_ids"]
    assert ids == [1, 403, 407, 261, 378]
    text = tok.decode(generate(rt, [ids], 20, end_ids=2)[0])
    assert text.startswith(", there was a little girl named Lily")


def test_kv_head_replication_two_kv_heads_at_tp4(hf_models, prompts, oracle, tmp_path):
    """llama3 synthetic has 8 heads / 2 KV heads: at tp=4 each KV head is duplicated onto two ranks."""
    from safetensors import safe_open

    ckpt = convert(hf_models["llama3"], tmp_path / "ckpt", tp=4, dtype="float32")
    d, h, nh = 8, 64, 8
    for r in range(4):
        with safe_open(str(ckpt / f"rank{r}.safetensors"), "pt") as f:
            qkv = f.get_tensor("transformer.layers.0.attention.qkv.weight")
        assert qkv.shape == ((nh // 4 + 2) * d, h)  # 2 q heads + 1 k head + 1 v head
    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f0, safe_open(str(ckpt / "rank1.safetensors"), "pt") as f1:
        k0 = f0.get_tensor("transformer.layers.0.attention.qkv.weight")[2 * d : 3 * d]
        k1 = f1.get_tensor("transformer.layers.0.attention.qkv.weight")[2 * d : 3 * d]
    assert torch.equal(k0, k1)  # ranks 0 and 1 share KV head 0
    oracle("llama3").assert_logits(load_checkpoint(ckpt)(torch.tensor(prompts["llama3"])), "llama3 tp4")


def test_half_precision_checkpoint_close_to_float32(hf_models, prompts, oracle, tmp_path):
    """dtype auto on a float32 source writes float16 (TensorRT-LLM's rule); the runtime computes exactly the
    model whose weights are rounded to float16 (the float64 oracle of those weights, within float32's error)."""
    ckpt = convert(hf_models["qwen2"], tmp_path / "ckpt", tp=2)
    rt = load_checkpoint(ckpt)
    assert rt.config["dtype"] == "float16"
    ids = torch.tensor(prompts["qwen2"])
    half64 = hf_float64(oracle("qwen2").model)  # float64 arithmetic on the float16-rounded weights
    for p in half64.parameters():  # weights only: buffers (rope inv_freq) stay exact
        p.data = p.data.half().double()
    with torch.no_grad():
        ref64 = half64(ids).logits
    assert_as_accurate(rt(ids), ref64, oracle("qwen2").scale, "qwen2 float16 checkpoint")
