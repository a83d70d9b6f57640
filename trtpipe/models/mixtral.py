"""Mixtral: Llama attention plus a sparse MoE block
(docs/reference/trtllm-checkpoint.md#weight-names-and-per-rank-shapes-llama-unquantized).

Experts fuse as ``mlp.fc = cat([stack(w3); stack(w1)], dim=-2)`` (linear half first, activated half
second: the reverse of GatedMLP's naming) and ``mlp.proj = stack(w2)``. The router stays float32.
"""

from __future__ import annotations

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.llama import ATTENTION_BIAS_RULES, ATTENTION_RULES, GLOBAL_RULES

EXPERT = "block_sparse_moe.experts.{e}."

MOE_RULES = (
    Rule("mlp.router.weight", ("block_sparse_moe.gate.weight",), (("E", "H"),), "replicate", dtype="float32"),
    Rule(
        "mlp.fc.weight", (EXPERT + "w3.weight", EXPERT + "w1.weight"), (("I", "H"), ("I", "H")), "moe_fc", "experts_cat"
    ),
    Rule("mlp.proj.weight", (EXPERT + "w2.weight",), (("H", "I"),), "moe_proj", "experts"),
)


def mixtral_fields(info: ModelDims) -> dict:
    return {
        "hidden_act": "swiglu",
        "attn_bias": info.attention_bias,
        "mlp_bias": False,
        "moe": {
            "num_experts": info.num_experts,
            "shared_expert_intermediate_size": 0,
            "top_k": info.experts_per_token,
            "normalization_mode": 1,  # RENORMALIZE
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
            "device_limited_n_group": 0,
            "device_limited_topk_group": 0,
            "device_limited_routed_scaling_factor": 1.0,
        },
    }


MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + ATTENTION_BIAS_RULES + MOE_RULES,
    config_fields=mixtral_fields,
)
