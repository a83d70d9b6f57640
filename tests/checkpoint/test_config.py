"""config.json as TensorRT-LLM reads it: rope from both HF layouts, sliding window, MoE, dtype auto, mapping."""

from __future__ import annotations

import json

import pytest
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.models import REGISTRY, get_family
from trtpipe.models.synthetic import make_synthetic
from trtpipe.models.trtllm_config import resolve_dtype

LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
COMMON = (
    "architecture",
    "dtype",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_size",
    "hidden_act",
    "position_embedding_type",
    "max_position_embeddings",
    "norm_epsilon",
    "logits_dtype",
    "rotary_base",
    "rotary_scaling",
    "rotary_embedding_dim",
    "mapping",
    "quantization",
    "use_parallel_embedding",
    "embedding_sharding_dim",
    "tie_word_embeddings",
    "moe",
    "mlp_bias",
    "attn_bias",
)


def _config(kind, tmp_path, layout="v5", **kw):
    hf = make_synthetic(kind, tmp_path / "hf", rope_layout=layout)
    return json.loads((convert(hf, tmp_path / "ck", **kw) / "config.json").read_text())


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_llama3_rope_from_both_layouts(tmp_path, layout):
    hf_cfg = json.loads((make_synthetic("llama3", tmp_path / "hf", rope_layout=layout) / "config.json").read_text())
    assert ("rope_scaling" in hf_cfg) == (layout == "v4")
    cfg = json.loads((convert(tmp_path / "hf", tmp_path / "ck", tp=2) / "config.json").read_text())
    assert set(COMMON) <= set(cfg)
    assert cfg["rotary_base"] == 500000.0
    assert cfg["rotary_scaling"]["rope_type"] == cfg["rotary_scaling"]["type"] == "llama3"
    assert {k: cfg["rotary_scaling"][k] for k in LLAMA3_SCALING} == LLAMA3_SCALING
    assert cfg["position_embedding_type"] == "rope_gpt_neox"
    assert cfg["mapping"]["world_size"] == 2 and cfg["mapping"]["tp_size"] == 2
    assert cfg["quantization"]["quant_algo"] is None and cfg["quantization"]["group_size"] == 128


def test_mistral_sliding_window_and_dtype_auto(tmp_path):
    cfg = _config("mistral", tmp_path)
    assert cfg["architecture"] == "MistralForCausalLM"
    assert cfg["sliding_window"] == 8
    assert cfg["dtype"] == "float16"  # float32 source under auto


def test_mixtral_moe_fields(tmp_path):
    cfg = _config("mixtral", tmp_path, tp=2, moe_ep=2)
    assert cfg["hidden_act"] == "swiglu"
    assert cfg["moe"]["num_experts"] == 4 and cfg["moe"]["top_k"] == 2 and cfg["moe"]["normalization_mode"] == 1
    assert cfg["mapping"]["moe_ep_size"] == 2 and cfg["mapping"]["moe_tp_size"] == 1


def test_mixtral_router_is_float32_and_experts_ordered_w3_w1(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    hf = make_synthetic("mixtral", tmp_path / "hf")
    ck = convert(hf, tmp_path / "ck", tp=2, moe_ep=2, dtype="bfloat16")
    src = load_file(hf / "model.safetensors")
    with safe_open(str(ck / "rank1.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.router.weight").dtype == torch.float32
        fc = f.get_tensor("transformer.layers.0.mlp.fc.weight")  # experts 2, 3
    assert fc.dtype == torch.bfloat16 and fc.shape == (2, 128, 64)
    w3 = src["model.layers.0.block_sparse_moe.experts.2.w3.weight"].bfloat16()
    w1 = src["model.layers.0.block_sparse_moe.experts.2.w1.weight"].bfloat16()
    assert torch.equal(fc[0], torch.cat([w3, w1]))


def test_qwen2_bias_and_mlp_naming(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    hf = make_synthetic("qwen2", tmp_path / "hf")
    ck = convert(hf, tmp_path / "ck", dtype="float32")
    src = load_file(hf / "model.safetensors")
    with safe_open(str(ck / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
        assert torch.equal(
            f.get_tensor("transformer.layers.0.mlp.fc.weight"), src["model.layers.0.mlp.gate_proj.weight"]
        )
        assert torch.equal(
            f.get_tensor("transformer.layers.0.mlp.gate.weight"), src["model.layers.0.mlp.up_proj.weight"]
        )
    assert "transformer.layers.0.attention.qkv.bias" in names
    assert "transformer.layers.0.attention.dense.bias" not in names


@pytest.mark.parametrize("src,auto", [("float32", "float16"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_dtype_auto_rule(src, auto):
    assert resolve_dtype("auto", src) == auto
    assert resolve_dtype("bfloat16", src) == "bfloat16"


def test_registry_keys_and_aliases():
    assert get_family("MistralForCausalLM") is get_family("LlamaForCausalLM")
    assert set(REGISTRY) == {
        "DeepseekV3ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "MixtralForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "GptOssForCausalLM",
    }
    assert get_family("Gemma3ForConditionalGeneration") is get_family("Gemma3ForCausalLM")  # its language model


def test_tokenizer_and_generation_config_copied(stories_dir, tmp_path):
    ck = convert(stories_dir, tmp_path / "ck", tp=2, pp=2)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (ck / name).read_bytes() == (stories_dir / name).read_bytes()
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 512
    assert sorted(p.name for p in ck.glob("rank*.safetensors")) == [f"rank{r}.safetensors" for r in range(4)]


def test_parallel_embedding_pads_and_splits_vocab(stories_dir, tmp_path):
    from safetensors import safe_open

    from trtpipe.runtime import load_checkpoint

    ck = convert(stories_dir, tmp_path / "ck", tp=4, dtype="float32", use_parallel_embedding=True)
    with safe_open(str(ck / "rank3.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.vocab_embedding.weight").shape == (128, 64)
        assert f.get_tensor("lm_head.weight").shape == (128, 64)
    plain = load_checkpoint(convert(stories_dir, tmp_path / "plain", tp=1, dtype="float32"))
    ids = torch.tensor([[1, 403, 407, 261, 378]])
    from numerics import assert_as_accurate, error_scale, float64_copy

    ref = float64_copy(plain)(ids)  # float64 truth; the unsplit float32 run sets float32's error scale
    assert_as_accurate(load_checkpoint(ck)(ids), ref, error_scale(plain(ids), ref), "tp=4 parallel embedding")
