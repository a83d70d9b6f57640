"""Qwen3 dense: HF ``Qwen3ForCausalLM`` -> TRT-LLM ``QWenForCausalLM`` with ``qwen_type: qwen3``.

What differs from Llama: an explicit ``head_dim`` (128 in every released size, so heads*head_dim is not hidden in
0.6B, 4B and 32B), no q/k/v bias, and a per-head RMSNorm of q and of k over head_dim (one weight vector shared by
all heads) applied before RoPE. The norms keep their HF roles under TRT-LLM's names
``attention.q_layernorm`` / ``attention.k_layernorm`` and are never quantized.

Upstream (TensorRT-LLM v1.2, ``tensorrt_llm/models/qwen/config.py`` and ``model.py``): ``QWenConfig.from_hugging_face``
sets ``head_size`` from ``head_dim``, forces ``attn_bias`` false for qwen3, reads ``rope_theta`` with a 100000
default (transformers 5 configs have no such attribute, so trtpipe writes ``rotary_base`` itself), and
``QWenDecoderLayer`` turns the q/k norms on from ``qwen_type`` alone (``qk_layernorm`` is written as true here for
readers of the file; the builder does not read it).
"""

from __future__ import annotations

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.llama import ATTENTION_RULES, GLOBAL_RULES, MLP_RULES

QK_NORM_RULES = (
    Rule("attention.q_layernorm.weight", ("self_attn.q_norm.weight",), (("D",),), "replicate"),
    Rule("attention.k_layernorm.weight", ("self_attn.k_norm.weight",), (("D",),), "replicate"),
)


def qwen3_fields(info: ModelDims) -> dict:
    return {"qwen_type": "qwen3", "attn_bias": False, "mlp_bias": False, "dense_bias": False, "qk_layernorm": True}


QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + QK_NORM_RULES + MLP_RULES,
    config_fields=qwen3_fields,
    qk_norm=True,
)
