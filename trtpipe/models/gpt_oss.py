"""gpt-oss: HF ``GptOssForCausalLM`` (openai/gpt-oss-20b, -120b). TensorRT-LLM 1.2 has no engine for it (not in
``MODEL_MAP``; only the PyTorch backend's ``_torch/models/modeling_gpt_oss.py``), so it deploys with ``target: llmapi``;
these rules map it onto the reference runtime's TensorRT-LLM-style names, which is what the runtime, calibration and
the llmapi export read.

What differs from Llama (transformers 5.24 ``models/gpt_oss/modeling_gpt_oss.py``, the oracle):

* attention: biased q/k/v/o, ``head_dim`` 64 (q width 4096 > hidden 2880), scale ``head_dim ** -0.5``, and a learned
  logit per query head (``self_attn.sinks``) appended as one more column of the softmax and dropped after it: the
  probabilities of a row sum to less than 1. Layers alternate ``sliding_attention`` (window ``sliding_window``, 128;
  key allowed iff ``q - k < window``) and ``full_attention`` (``layer_types``; layer 0 slides).
* RoPE: YaRN (factor 32 over 4096 original positions, beta 32/1, ``truncate: false``), cos/sin multiplied by
  ``0.1 ln 32 + 1``; the half-split rotation (GPT-NeoX layout).
* every layer is MoE: the router ``mlp.router`` is a biased linear [E, hidden]; top-k on its logits, then softmax over
  those k (equal to a softmax over all experts renormalized over the top k: TensorRT-LLM's RENORMALIZE).
* experts are fused on disk: ``mlp.experts.gate_up_proj`` [E, hidden, 2I] stored in -> out with **gate and up
  interleaved** (gate = even columns, up = odd), ``down_proj`` [E, I, hidden], biases ``gate_up_proj_bias`` [E, 2I]
  (same interleave) and ``down_proj_bias`` [E, hidden]. The expert is a clamped SwiGLU:
  ``g = min(g, limit); u = clamp(u, -limit, limit); y = ((u + 1) * g * sigmoid(alpha * g)) W_d + b_d`` with
  ``swiglu_limit`` 7 and ``alpha`` 1.702 (transformers' ``swiglu_alpha`` default; the hub config.json has no such key).

The shipped checkpoints hold the experts in MXFP4 (``config.json`` ``quantization_config.quant_method: mxfp4``):
``{gate_up,down}_proj_blocks`` [E, out, in/32, 16] and ``_scales`` [E, out, in/32] (:mod:`trtpipe.formats.mxfp4`),
rows of ``gate_up`` interleaved the same way. Conversion dequantizes them exactly (every MXFP4 value is a float32);
the llmapi export writes them back as shipped.

The fused experts become TensorRT-LLM's MoE layout: ``mlp.fc`` [E, 2I, hidden] = ``[up; gate]`` (the linear half
first, as for Mixtral), ``mlp.proj`` [E, hidden, I], with ``mlp.fc.bias`` [E, 2I] in the same order.
"""

from __future__ import annotations

from typing import Iterable

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.llama import ATTENTION_BIAS_RULES, ATTENTION_RULES, GLOBAL_RULES

SWIGLU_ALPHA = 1.702  # transformers 5.24 GptOssConfig.swiglu_alpha default; upstream TRT-LLM hard-codes the same
SWIGLU_LIMIT = 7.0
EXPERTS = "mlp.experts."
NO_ENGINE = (
    "TensorRT-LLM 1.2 has no TensorRT engine for GptOssForCausalLM (not in tensorrt_llm.models.MODEL_MAP; "
    "only its PyTorch backend runs it)"
)


def mxfp4_experts(info: ModelDims) -> bool:
    """The checkpoint ships its experts in MXFP4 (``*_blocks`` / ``*_scales``), as openai/gpt-oss-* do."""
    return info.quant_method == "mxfp4"


def _bf16_experts(info: ModelDims) -> bool:
    return not mxfp4_experts(info)


MOE_RULES = (
    Rule("mlp.router.weight", ("mlp.router.weight",), (("E", "H"),), "replicate", dtype="float32"),
    Rule("mlp.router.bias", ("mlp.router.bias",), (("E",),), "replicate", dtype="float32"),
    Rule("mlp.fc.weight", (EXPERTS + "gate_up_proj",), (("E", "H", "2M"),), "moe_fc", "gate_up_t", when=_bf16_experts),
    Rule("mlp.proj.weight", (EXPERTS + "down_proj",), (("E", "M", "H"),), "moe_proj", "transposed", when=_bf16_experts),
    Rule(
        "mlp.fc.weight",
        (EXPERTS + "gate_up_proj_blocks", EXPERTS + "gate_up_proj_scales"),
        (("E", "2M", "H/32", "16"), ("E", "2M", "H/32")),
        "moe_fc",
        "mxfp4_gate_up",
        when=mxfp4_experts,
    ),
    Rule(
        "mlp.proj.weight",
        (EXPERTS + "down_proj_blocks", EXPERTS + "down_proj_scales"),
        (("E", "H", "M/32", "16"), ("E", "H", "M/32")),
        "moe_proj",
        "mxfp4",
        when=mxfp4_experts,
    ),
    Rule("mlp.fc.bias", (EXPERTS + "gate_up_proj_bias",), (("E", "2M"),), "moe_fc", "gate_up_t"),
    Rule("mlp.proj.bias", (EXPERTS + "down_proj_bias",), (("E", "H"),), "moe_proj"),
)

SINK_RULES = (Rule("attention.sinks", ("self_attn.sinks",), (("NH",),), "column"),)


def gpt_oss_fields(info: ModelDims) -> dict:
    return {
        "hidden_act": "swiglu",
        "attn_bias": info.attention_bias,
        "mlp_bias": True,
        "swiglu_alpha": float(SWIGLU_ALPHA if info.swiglu_alpha is None else info.swiglu_alpha),
        "swiglu_beta": 1.0,
        "swiglu_limit": float(SWIGLU_LIMIT if info.swiglu_limit is None else info.swiglu_limit),
        "attention_sinks": True,
        "layer_types": list(info.layer_types),
        # the experts' storage when it is not the checkpoint dtype (what the planner counts; the runtime decodes them)
        "expert_quant_algo": "W4A16_MXFP4" if mxfp4_experts(info) else None,
        "moe": {
            "num_experts": info.num_experts,
            "shared_expert_intermediate_size": 0,
            "top_k": info.experts_per_token,
            "normalization_mode": 1,  # RENORMALIZE: top-k logits then softmax (RenormalizeMoeRoutingMethod upstream)
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
            "device_limited_n_group": 0,
            "device_limited_topk_group": 0,
            "device_limited_routed_scaling_factor": 1.0,
        },
    }


def gpt_oss_unsupported(info: ModelDims) -> Iterable[tuple[str, str]]:
    kinds = set(info.layer_types) - {"sliding_attention", "full_attention"}
    if kinds:
        yield "layer_types", f"layer type(s) {sorted(kinds)} (known: sliding_attention, full_attention)"
    if "sliding_attention" in info.layer_types and not info.sliding_window:
        yield "sliding_window", "is missing or 0 but layer_types has sliding layers; allowed: a window of >= 1 token"
    if not info.is_moe or info.experts_per_token < 1:
        yield (
            "num_local_experts",
            (
                f"{info.num_experts} experts, top {info.experts_per_token}: gpt-oss is "
                "mixture-of-experts in every layer (>= 2 experts, num_experts_per_tok >= 1)"
            ),
        )
    method = info.quant_method
    if method not in (None, "mxfp4"):
        yield "quantization_config.quant_method", f"'{method}' is not supported for gpt-oss; allowed: mxfp4 or none"
    if method == "mxfp4":
        for key, size in (("hidden_size", info.hidden_size), ("intermediate_size", info.intermediate_size)):
            if size % 32:
                yield key, f"{size} is not a multiple of 32, the MXFP4 group the experts are stored in"


GPT_OSS = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + ATTENTION_BIAS_RULES + SINK_RULES + MOE_RULES,
    config_fields=gpt_oss_fields,
    unsupported=gpt_oss_unsupported,
    no_engine=NO_ENGINE,
    kept_unquantized=("*mlp.fc", "*mlp.proj"),  # the experts: exported as shipped (MXFP4) or as the bf16 source
    shipped_quantization=("mxfp4",),  # so quantization.algo: fp8 quantizes attention and keeps the experts MXFP4
    biased_moe=True,
    attention_sinks=True,
)
