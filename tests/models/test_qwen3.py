"""Qwen3 dense through both targets' readers: the engine-path checkpoint (TRT-LLM names, q/k norms as
``attention.q_layernorm``/``k_layernorm``) and the llmapi path (the HF layout itself, and trtpipe's unified export of
it), each against transformers in float64 on a synthetic model with Qwen3-4B's ratios (q wider than hidden)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from numerics import assert_as_accurate, assert_greedy_equal, error_scale, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.export.unified import export_unified
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import generate, load_checkpoint
from trtpipe.runtime.hf_loader import load_hf_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = make_synthetic("qwen3", tmp_path_factory.mktemp("qwen3") / "hf", seed=3)
    hf = load_hf(d)
    ids = torch.randint(3, 250, (3, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits32 = hf(ids).logits
        logits64 = hf_float64(hf)(ids).logits
    return {
        "dir": d,
        "hf": hf,
        "hf64": hf_float64(hf),
        "ids": ids,
        "ref64": logits64,
        "scale": error_scale(logits32, logits64),
    }


def test_checkpoint_names_the_qk_norms_as_trtllm_and_writes_head_size(qwen3, tmp_path):
    ckpt = convert(qwen3["dir"], tmp_path / "ckpt", tp=2, dtype="float32")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert (cfg["architecture"], cfg["qwen_type"], cfg["head_size"], cfg["attn_bias"]) == (
        "Qwen3ForCausalLM",
        "qwen3",
        16,
        False,
    )
    assert cfg["rotary_base"] == 1e6 and cfg["norm_epsilon"] == 1e-6  # written, never left to upstream's defaults
    with safe_open(str(ckpt / "rank1.safetensors"), "pt") as f:
        qkv = f.get_tensor("transformer.layers.1.attention.qkv.weight")
        q_norm = f.get_tensor("transformer.layers.1.attention.q_layernorm.weight")
    assert qkv.shape == ((8 // 2 + 2 * 2 // 2) * 16, 64)  # 4 q heads + 1 k + 1 v head of 16 on each of 2 ranks
    assert torch.equal(q_norm, qwen3["hf"].model.layers[1].self_attn.q_norm.weight.detach())  # replicated, whole


def test_a_checkpoint_missing_one_of_the_qk_norms_is_refused(qwen3, tmp_path):
    from safetensors.torch import load_file, save_file

    from trtpipe.errors import CheckpointError

    ckpt = convert(qwen3["dir"], tmp_path / "ckpt", tp=1, dtype="float32")
    t = load_file(str(ckpt / "rank0.safetensors"))
    del t["transformer.layers.0.attention.k_layernorm.weight"]
    save_file(t, str(ckpt / "rank0.safetensors"))
    with pytest.raises(CheckpointError, match="k_layernorm.weight' come together; one is missing"):
        load_checkpoint(ckpt)


def test_hf_layout_runs_as_transformers(qwen3):
    rt = load_hf_checkpoint(qwen3["dir"])
    assert_as_accurate(rt(qwen3["ids"]), qwen3["ref64"], qwen3["scale"], "qwen3 HF layout")


def test_unified_export_round_trips_with_the_qk_norms(qwen3, tmp_path):
    ckpt = convert(qwen3["dir"], tmp_path / "ckpt", tp=2, dtype="float32")
    out = tmp_path / "unified"
    export_unified(ckpt, qwen3["dir"], None, out, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=[])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names
    rt = load_hf_checkpoint(out)
    assert_as_accurate(rt(qwen3["ids"]), qwen3["ref64"], qwen3["scale"], "qwen3 unified export")
    want = qwen3["hf"].generate(qwen3["ids"][:1], max_new_tokens=24, do_sample=False, pad_token_id=0)[0, 20:].tolist()
    prompt = qwen3["ids"][0].tolist()
    assert_greedy_equal(
        generate(rt, [prompt], 24, end_ids=None)[0],
        want,
        qwen3["hf"],
        qwen3["hf64"],
        prompt,
        "qwen3 unified export greedy",
    )
