"""Qwen3-MoE: HF ``Qwen3MoeForCausalLM`` -> TRT-LLM ``QWenForCausalLM`` with ``qwen_type: qwen3_moe``.

Qwen3's attention (explicit head_dim, q/k norms; :mod:`trtpipe.models.qwen3`) with a sparse MoE block in every layer:
a router ``mlp.gate`` [E, hidden] (kept float32, never quantized), no shared expert, experts of width
``moe_intermediate_size`` fused as TRT-LLM's MoE reads them: ``mlp.fc = cat([stack(up_proj); stack(gate_proj)],
dim=-2)`` (the linear half first, as for Mixtral) and ``mlp.proj = stack(down_proj)``.

Routing: softmax over all experts, top-k; with ``norm_topk_prob`` (true in the released models) the k weights are
divided by their sum. That is TRT-LLM's RENORMALIZE (``moe.normalization_mode: 1``); upstream's
``QWenConfig.from_hugging_face`` (TensorRT-LLM v1.2 ``tensorrt_llm/models/qwen/config.py``) writes NONE for every Qwen
MoE type and ignores ``norm_topk_prob``, which would weight the experts of a released model differently from
transformers. trtpipe writes the mode that matches the checkpoint.

Layer patterns the TRT-LLM model cannot express (``mlp_only_layers`` not empty, ``decoder_sparse_step`` other than 1:
dense MLPs between MoE layers) are refused; upstream's converter stacks experts for every layer.

On the PyTorch backend (``target: llmapi``; NVIDIA/TensorRT-LLM@a678b91a
``tensorrt_llm/_torch/models/modeling_qwen3_moe.py``) the router ``Qwen3Gate`` weight is in the model dtype, and
``Qwen3MoEModel`` builds the embedding with ``tensor_parallel_mode=TensorParallelMode.COLUMN`` (one vocab slice
per tp rank) unless attention data parallelism is on: the planner counts those bytes for that target.
"""

from __future__ import annotations

from typing import Iterable

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.llama import ATTENTION_RULES, GLOBAL_RULES
from trtpipe.models.qwen3 import QK_NORM_RULES

EXPERT = "mlp.experts.{e}."

MOE_RULES = (
    Rule("mlp.router.weight", ("mlp.gate.weight",), (("E", "H"),), "replicate", dtype="float32"),
    Rule(
        "mlp.fc.weight",
        (EXPERT + "up_proj.weight", EXPERT + "gate_proj.weight"),
        (("M", "H"), ("M", "H")),
        "moe_fc",
        "experts_cat",
    ),
    Rule("mlp.proj.weight", (EXPERT + "down_proj.weight",), (("H", "M"),), "moe_proj", "experts"),
)


def qwen3_moe_fields(info: ModelDims) -> dict:
    return {
        "qwen_type": "qwen3_moe",
        "hidden_act": "swiglu",
        "attn_bias": False,
        "mlp_bias": False,
        "dense_bias": False,
        "qk_layernorm": True,
        "moe_intermediate_size": info.expert_intermediate_size,
        "moe_shared_expert_intermediate_size": 0,
        "moe": {
            "num_experts": info.num_experts,
            "shared_expert_intermediate_size": 0,
            "top_k": info.experts_per_token,
            "normalization_mode": 1 if info.moe_renormalize else 0,  # RENORMALIZE iff norm_topk_prob, see the docstring
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
            "device_limited_n_group": 0,
            "device_limited_topk_group": 0,
            "device_limited_routed_scaling_factor": 1.0,
        },
    }


def qwen3_moe_unsupported(info: ModelDims) -> Iterable[tuple[str, str]]:
    dense = info.raw.get("mlp_only_layers") or []
    if dense:
        yield "mlp_only_layers", f"{list(dense)} (dense MLP layers between MoE layers) is not supported; allowed: []"
    step = info.moe_layer_step
    if step != 1:
        yield "decoder_sparse_step", f"{step} (MoE every {step} layers) is not supported; allowed: 1"
    if not info.is_moe:
        yield "num_experts", f"{info.num_experts}: a Qwen3-MoE model needs at least 2 experts"


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + QK_NORM_RULES + MOE_RULES,
    config_fields=qwen3_moe_fields,
    unsupported=qwen3_moe_unsupported,
    llmapi_vocab_parallel=True,
    llmapi_router_in_model_dtype=True,
    qk_norm=True,
)
