"""DeepSeek-V3 / R1 and Kimi-K2: HF ``DeepseekV3ForCausalLM``. TensorRT-LLM 1.2 has no TensorRT engine for it
(``tensorrt_llm/models/__init__.py`` ``MODEL_MAP`` lists ``DeepseekV2ForCausalLM`` but no V3; read in the code index,
which gave no commit for that copy), only the PyTorch backend (``tensorrt_llm/_torch/models/modeling_deepseekv3.py``),
so it deploys with ``target: llmapi``; these rules map it onto the reference runtime's TensorRT-LLM-style names, which
is what the runtime reads (the oracle: transformers 5.25 ``models/deepseek_v3/modeling_deepseek_v3.py``).

Multi-head latent attention (MLA), per layer:

* ``q = q_b(RMSNorm(q_a(x)))`` (or one ``q_proj`` when ``q_lora_rank`` is null), ``heads x (nope + rope)`` wide;
* ``c, k_rope = split(kv_a(x), [kv_lora_rank, qk_rope_head_dim])``, ``c = RMSNorm(c)``: the latent ``c`` and the one
  rope key every head shares are all the KV cache holds, ``kv_lora_rank + qk_rope_head_dim`` values per token per
  layer (576 for DeepSeek-V3);
* ``k_nope, v = split(kv_b(c))`` per head; RoPE on the rope parts only, over interleaved pairs when
  ``rope_interleave`` (the released configs); scores over nope || rope, scale ``qk_head_dim ** -0.5 * mscale**2``
  with ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` under YaRN (transformers ``yarn_apply_mscale``).

Layers ``< first_k_dense_replace`` have a dense gated MLP (named ``ffn.*`` here so that its ``fc`` is not an MoE
layer's ``mlp.fc``); the others are MoE: a float32 router ``mlp.router`` [E, hidden] with its
``e_score_correction_bias`` [E], routed experts fused as every MoE family here (``mlp.fc = [up; gate]``,
``mlp.proj``), and the shared experts ``mlp.shared_expert.*`` (width ``moe_intermediate_size x n_shared_experts``) that
every token goes through. Routing (``noaux_tc``): sigmoid scores; the bias is added for the choice only; experts
split into ``n_group`` groups, a group scores the sum of its two best biased scores, the best ``topk_group`` groups
are kept, the top-k experts chosen among them; their weights are the unbiased scores, divided by their sum when
``norm_topk_prob``, times ``routed_scaling_factor``.

DeepSeek's checkpoints ship block-scaled FP8 (``quantization_config.quant_method: fp8``, ``weight_block_size [128,
128]``: every decoder projection's ``weight`` in float8_e4m3fn with one float32 ``weight_scale_inv`` per 128 x 128
block; the router, norms, embedding and lm_head unquantized): the llmapi export passes them through file for file
(:mod:`trtpipe.export.imported`) and the reference runtime executes them as stored
(:mod:`trtpipe.runtime.hf_loader`: weights dequantized, activations FP8 per token and group of 128 inputs).

The multi-token-prediction layers (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers + i}``)
are not part of the decoder: the conversion skips them (they are read for MTP speculative decoding by the PyTorch
backend) and the llmapi export keeps them.
"""

from __future__ import annotations

from typing import Iterable

from trtpipe.models.dims import ModelDims
from trtpipe.models.family import Family, Rule
from trtpipe.models.llama import GLOBAL_RULES

NO_ENGINE = (
    "TensorRT-LLM 1.2 has no TensorRT engine for DeepseekV3ForCausalLM (tensorrt_llm.models.MODEL_MAP has "
    "DeepseekV2ForCausalLM, no V3; only its PyTorch backend runs it)"
)
EXPERT = "mlp.experts.{e}."
ATTN = "self_attn."


def _q_lora(info: ModelDims) -> bool:
    return bool(info.mla and info.mla.q_lora_rank)


def _q_full(info: ModelDims) -> bool:
    return not _q_lora(info)


ATTENTION_RULES = (
    Rule("input_layernorm.weight", ("input_layernorm.weight",), (("H",),), "replicate"),
    Rule("attention.q_a.weight", (ATTN + "q_a_proj.weight",), (("QA", "H"),), "replicate", when=_q_lora),
    Rule("attention.q_a_layernorm.weight", (ATTN + "q_a_layernorm.weight",), (("QA",),), "replicate", when=_q_lora),
    Rule("attention.q_b.weight", (ATTN + "q_b_proj.weight",), (("QB", "QA"),), "column", when=_q_lora),
    Rule("attention.q.weight", (ATTN + "q_proj.weight",), (("QB", "H"),), "column", when=_q_full),
    Rule("attention.kv_a.weight", (ATTN + "kv_a_proj_with_mqa.weight",), (("KVA", "H"),), "replicate"),
    Rule("attention.kv_a_layernorm.weight", (ATTN + "kv_a_layernorm.weight",), (("KVL",),), "replicate"),
    Rule("attention.kv_b.weight", (ATTN + "kv_b_proj.weight",), (("KVB", "KVL"),), "column"),
    Rule("attention.dense.weight", (ATTN + "o_proj.weight",), (("H", "O"),), "row"),
    Rule("post_layernorm.weight", ("post_attention_layernorm.weight",), (("H",),), "replicate"),
)

DENSE_RULES = (
    Rule("ffn.fc.weight", ("mlp.gate_proj.weight",), (("I", "H"),), "column", layers="dense"),
    Rule("ffn.gate.weight", ("mlp.up_proj.weight",), (("I", "H"),), "column", layers="dense"),
    Rule("ffn.proj.weight", ("mlp.down_proj.weight",), (("H", "I"),), "row", layers="dense"),
)

MOE_RULES = (
    Rule("mlp.router.weight", ("mlp.gate.weight",), (("E", "H"),), "replicate", dtype="float32", layers="moe"),
    Rule(
        "mlp.router.e_score_correction_bias",
        ("mlp.gate.e_score_correction_bias",),
        (("E",),),
        "replicate",
        dtype="float32",
        layers="moe",
    ),
    Rule(
        "mlp.fc.weight",
        (EXPERT + "up_proj.weight", EXPERT + "gate_proj.weight"),
        (("M", "H"), ("M", "H")),
        "moe_fc",
        "experts_cat",
        layers="moe",
    ),
    Rule("mlp.proj.weight", (EXPERT + "down_proj.weight",), (("H", "M"),), "moe_proj", "experts", layers="moe"),
    Rule(
        "mlp.shared_expert.fc.weight", ("mlp.shared_experts.gate_proj.weight",), (("S", "H"),), "column", layers="moe"
    ),
    Rule(
        "mlp.shared_expert.gate.weight", ("mlp.shared_experts.up_proj.weight",), (("S", "H"),), "column", layers="moe"
    ),
    Rule("mlp.shared_expert.proj.weight", ("mlp.shared_experts.down_proj.weight",), (("H", "S"),), "row", layers="moe"),
)


def deepseek_v3_fields(info: ModelDims) -> dict:
    """The MLA ranks and routing under their HF names (the runtime reads them back through ``checkpoint_view``)."""
    a = info.mla
    return {
        "hidden_act": "swiglu",
        "head_size": a.qk_head_dim,
        "rotary_embedding_dim": a.qk_rope_head_dim,
        "q_lora_rank": a.q_lora_rank or None,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "rope_interleave": info.rope_interleave,
        "first_k_dense_replace": info.dense_layers,
        "n_shared_experts": info.shared_experts,
        "moe_intermediate_size": info.expert_intermediate_size,
        "scoring_func": info.moe_scoring,
        "n_group": info.moe_groups,
        "topk_group": info.moe_topk_groups,
        "routed_scaling_factor": info.routed_scaling_factor,
        "mtp_layers": info.mtp_layers,
        "moe": {
            "num_experts": info.num_experts,
            "shared_expert_intermediate_size": info.expert_intermediate_size * info.shared_experts,
            "top_k": info.experts_per_token,
            "normalization_mode": 1 if info.moe_renormalize else 0,
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
            "device_limited_n_group": info.moe_groups,
            "device_limited_topk_group": info.moe_topk_groups,
            "device_limited_routed_scaling_factor": info.routed_scaling_factor,
        },
    }


def deepseek_v3_unsupported(info: ModelDims) -> Iterable[tuple[str, str]]:
    if info.mla is None:
        yield "kv_lora_rank", "is missing or 0: DeepseekV3ForCausalLM is multi-head latent attention"
        return
    if info.moe_scoring != "sigmoid":
        yield "scoring_func", f"'{info.moe_scoring}' is not supported; allowed: sigmoid (DeepSeek-V3's noaux_tc)"
    if not info.is_moe or info.experts_per_token < 1:
        yield "n_routed_experts", f"{info.num_experts} experts, top {info.experts_per_token}: need >= 2 and >= 1"
        return
    if info.moe_groups < 1 or info.num_experts % info.moe_groups:
        yield "n_group", f"{info.moe_groups} does not divide n_routed_experts {info.num_experts}"
    elif not 1 <= info.moe_topk_groups <= info.moe_groups:
        yield "topk_group", f"{info.moe_topk_groups} is not between 1 and n_group {info.moe_groups}"
    elif info.num_experts // info.moe_groups < 2:
        yield "n_group", f"{info.moe_groups} groups of one expert: a group scores its two best experts"
    elif info.experts_per_token > info.moe_topk_groups * (info.num_experts // info.moe_groups):
        yield "num_experts_per_tok", f"{info.experts_per_token} is more than the kept groups hold"
    if info.attention_bias:
        yield "attention_bias", "true is not supported (the released DeepSeek-V3 and Kimi-K2 have none)"
    method = info.quant_method
    if method not in (None, "fp8"):
        yield "quantization_config.quant_method", f"'{method}' is not supported for DeepSeek-V3; allowed: fp8 or none"


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    global_rules=GLOBAL_RULES,
    layer_rules=ATTENTION_RULES + DENSE_RULES + MOE_RULES,
    config_fields=deepseek_v3_fields,
    unsupported=deepseek_v3_unsupported,
    no_engine=NO_ENGINE,
    llmapi_router_in_model_dtype=False,
    # calibration, the quantizers and the twin's FP8 KV cache know q/k/v attention, not MLA's latent projections
    no_recipe_quantization=(
        "trtpipe quantizes neither MLA projections nor the latent KV cache; the shipped block FP8 is passed "
        "through as stored"
    ),
)
