"""Qwen2: Llama's layout plus q/k/v biases (no o_proj bias); TRT-LLM ``QWenForCausalLM`` with qwen_type qwen2."""

from __future__ import annotations

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.llama import ATTENTION_RULES, GLOBAL_RULES, MLP_RULES, QKV

QKV_BIAS = Rule("attention.qkv.bias", tuple(f"{p}.bias" for p in QKV), (("Q",), ("KV",), ("KV",)), "qkv", "cat")


def qwen2_fields(info: ModelDims) -> dict:
    return {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False, "dense_bias": False}


QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + (QKV_BIAS,) + MLP_RULES,
    config_fields=qwen2_fields,
)
