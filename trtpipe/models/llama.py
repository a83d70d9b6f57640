"""Llama 2/3 and Mistral: HF ``LlamaForCausalLM``/``MistralForCausalLM`` -> TRT-LLM ``LLaMAForCausalLM``.

Names and shards: docs/reference/trtllm-checkpoint.md#weight-names-and-per-rank-shapes-llama-unquantized.
The MLP naming quirk: TRT-LLM ``mlp.fc`` is the activated branch (HF ``gate_proj``) and
``mlp.gate`` the linear one (HF ``up_proj``).
"""

from __future__ import annotations

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims


def _attn_bias(info: ModelDims) -> bool:
    return info.attention_bias


def _mlp_bias(info: ModelDims) -> bool:
    return info.mlp_bias


def _untied(info: ModelDims) -> bool:
    return not info.tie_word_embeddings


def _tied(info: ModelDims) -> bool:
    return info.tie_word_embeddings


GLOBAL_RULES = (
    Rule("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",), (("V", "H"),), "embedding"),
    Rule("transformer.ln_f.weight", ("model.norm.weight",), (("H",),), "replicate"),
    Rule("lm_head.weight", ("lm_head.weight",), (("V", "H"),), "vocab", when=_untied),
    Rule("lm_head.weight", ("model.embed_tokens.weight",), (("V", "H"),), "vocab", when=_tied),
)

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

ATTENTION_RULES = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",), (("H",),), "replicate"),
    Rule(
        "attention.qkv.weight", tuple(f"{p}.weight" for p in QKV), (("Q", "H"), ("KV", "H"), ("KV", "H")), "qkv", "cat"
    ),
    Rule("attention.dense.weight", ("self_attn.o_proj.weight",), (("H", "Q"),), "row"),
    Rule("post_layernorm.weight", ("post_attention_layernorm.weight",), (("H",),), "replicate"),
)

ATTENTION_BIAS_RULES = (
    Rule(
        "attention.qkv.bias", tuple(f"{p}.bias" for p in QKV), (("Q",), ("KV",), ("KV",)), "qkv", "cat", when=_attn_bias
    ),
    Rule("attention.dense.bias", ("self_attn.o_proj.bias",), (("H",),), "row", when=_attn_bias),
)

MLP_RULES = (
    Rule("mlp.fc.weight", ("mlp.gate_proj.weight",), (("I", "H"),), "column"),
    Rule("mlp.gate.weight", ("mlp.up_proj.weight",), (("I", "H"),), "column"),
    Rule("mlp.proj.weight", ("mlp.down_proj.weight",), (("H", "I"),), "row"),
    Rule("mlp.fc.bias", ("mlp.gate_proj.bias",), (("I",),), "column", when=_mlp_bias),
    Rule("mlp.gate.bias", ("mlp.up_proj.bias",), (("I",),), "column", when=_mlp_bias),
    Rule("mlp.proj.bias", ("mlp.down_proj.bias",), (("H",),), "row", when=_mlp_bias),
)


def llama_fields(info: ModelDims) -> dict:
    return {"attn_bias": info.attention_bias, "mlp_bias": info.mlp_bias}


LLAMA = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + ATTENTION_BIAS_RULES + MLP_RULES,
    config_fields=llama_fields,
)
