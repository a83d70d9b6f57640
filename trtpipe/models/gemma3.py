"""Gemma 3 text: HF ``Gemma3ForCausalLM`` (and the language model of ``Gemma3ForConditionalGeneration``) ->
TRT-LLM ``Gemma3ForCausalLM``.

What differs from Llama (transformers 5.24 ``models/gemma3/modeling_gemma3.py``): every RMSNorm is zero-centred
(``x * rsqrt(mean(x^2) + eps) * (1 + w)``) and a layer has four of them (input, post-attention applied to the
attention OUTPUT, pre- and post-feed-forward), q and k get a per-head norm before RoPE, the embedding is scaled by
``sqrt(hidden)`` rounded to the weight dtype, the attention scale is ``query_pre_attn_scalar ** -0.5``, the MLP
activation is ``gelu_pytorch_tanh`` (config key ``hidden_activation``), and layers alternate between sliding-window
layers (rope base ``rope_local_base_freq``, unscaled) and global ones (``rope_theta`` with ``rope_scaling``): layer
i is global iff ``(i + 1) % sliding_window_pattern == 0``.

Upstream (NVIDIA/TensorRT-LLM v1.2 ``tensorrt_llm/models/gemma/{config,convert,model}.py``): the converter adds 1.0
to every norm weight in float32 before the dtype cast (``Rule.offset``), names the post-attention norm
``post_layernorm`` and the feed-forward ones ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``
(``inter_layernorms``), and copies the embedding to ``lm_head``. Two known gaps there are closed by writing the
fields here: ``GemmaConfig.from_hugging_face`` copies only ``hidden_act`` (HF writes ``hidden_activation``), and it
reads a rope-scaling key HF never writes (``getattr(hf_config, "rotary_scaling", None)``), so ``rotary_scaling``
(linear, factor 8 on 4B-27B) would be dropped. ``GemmaConfig.__init__`` also sets ``use_parallel_embedding`` to
``tp_size > 1`` whatever config.json says, so at tp > 1 the embedding is written vocab-sharded
(``Family.parallel_embedding_at_tp``).
The engine takes ``q_scaling = sqrt(query_pre_attn_scalar) / sqrt(head_size)`` from ``query_pre_attn_scalar``; it
does not carry the per-layer window: serving passes ``max_attention_window`` per layer
(``trtpipe.triton.repo``).
"""

from __future__ import annotations

from typing import Iterable

from trtpipe.models.family import Family, Rule
from trtpipe.models.dims import ModelDims
from trtpipe.models.hfconfig import rope_of
from trtpipe.models.llama import QKV

GEMMA_NORM = 1.0  # TRT-LLM's Gemma checkpoints hold 1 + w


def _norm(trt: str, hf: str, dim: str = "H") -> Rule:
    return Rule(trt, (hf,), ((dim,),), "replicate", offset=GEMMA_NORM)


def _untied(info: ModelDims) -> bool:
    return not info.tie_word_embeddings


def _tied(info: ModelDims) -> bool:
    return info.tie_word_embeddings


GLOBAL_RULES = (
    Rule("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",), (("V", "H"),), "embedding"),
    _norm("transformer.ln_f.weight", "model.norm.weight"),
    Rule("lm_head.weight", ("lm_head.weight",), (("V", "H"),), "vocab", when=_untied),
    Rule("lm_head.weight", ("model.embed_tokens.weight",), (("V", "H"),), "vocab", when=_tied),
)

LAYER_RULES = (
    _norm("input_layernorm.weight", "input_layernorm.weight"),
    Rule(
        "attention.qkv.weight", tuple(f"{p}.weight" for p in QKV), (("Q", "H"), ("KV", "H"), ("KV", "H")), "qkv", "cat"
    ),
    _norm("attention.q_layernorm.weight", "self_attn.q_norm.weight", "D"),
    _norm("attention.k_layernorm.weight", "self_attn.k_norm.weight", "D"),
    Rule("attention.dense.weight", ("self_attn.o_proj.weight",), (("H", "Q"),), "row"),
    _norm("post_layernorm.weight", "post_attention_layernorm.weight"),
    _norm("pre_feedforward_layernorm.weight", "pre_feedforward_layernorm.weight"),
    _norm("post_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    Rule("mlp.fc.weight", ("mlp.gate_proj.weight",), (("I", "H"),), "column"),
    Rule("mlp.gate.weight", ("mlp.up_proj.weight",), (("I", "H"),), "column"),
    Rule("mlp.proj.weight", ("mlp.down_proj.weight",), (("H", "I"),), "row"),
)


def sliding_window_pattern(info: ModelDims) -> int:
    """The period of the local/global pattern (layer i global iff (i+1) % n == 0); 1 when every layer is global."""
    globals_ = [i for i, t in enumerate(info.layer_types) if t == "full_attention"]
    return globals_[0] + 1 if globals_ else len(info.layer_types) + 1


def gemma3_fields(info: ModelDims) -> dict:
    return {
        "architecture": "Gemma3ForCausalLM",  # the text model, also for a ConditionalGeneration source
        "hidden_act": info.hidden_act,  # written: upstream copies only HF's hidden_act, Gemma 3 has hidden_activation
        "attn_bias": False,
        "mlp_bias": False,
        "dense_bias": False,
        "qk_layernorm": True,
        "inter_layernorms": True,
        "query_pre_attn_scalar": info.query_pre_attn_scalar,
        "final_logit_softcapping": info.final_logit_softcapping,
        "attn_logit_softcapping": info.attn_logit_softcapping,
        "_sliding_window_pattern": sliding_window_pattern(info),
        "layer_types": list(info.layer_types),
        "rope_local_base_freq": info.rope_local_theta,
        "sliding_window": info.sliding_window,
    }


def gemma3_unsupported(info: ModelDims) -> Iterable[tuple[str, str]]:
    raw = info.raw
    if raw.get("use_bidirectional_attention"):
        yield (
            "use_bidirectional_attention",
            "bidirectional attention (EmbeddingGemma) is not causal decoding; "
            "TensorRT-LLM's Gemma 3 engine and the reference runtime attend causally only",
        )
    if info.attn_logit_softcapping is not None:
        yield (
            "attn_logit_softcapping",
            "attention-logit softcapping (Gemma 2) is not applied by the reference "
            "runtime's attention; Gemma 3 sets it null",
        )
    if rope_of(raw, "sliding_attention")[1] is not None:
        yield (
            "rope_parameters.sliding_attention",
            "rope scaling on the sliding layers: TensorRT-LLM's rope_local_base_freq is an unscaled base",
        )
    kinds = set(info.layer_types) - {"sliding_attention", "full_attention"}
    if kinds:
        yield ("layer_types", f"layer type(s) {sorted(kinds)} (known: sliding_attention, full_attention)")
    if "sliding_attention" in info.layer_types and not info.sliding_window:
        yield ("sliding_window", "sliding layers need a window")


GEMMA3 = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    global_rules=GLOBAL_RULES,
    layer_rules=LAYER_RULES,
    ignored_prefixes=("vision_tower.", "multi_modal_projector."),
    parallel_embedding_at_tp=True,
    config_fields=gemma3_fields,
    unsupported=gemma3_unsupported,
    embedding_in_exclude_modules=False,  # Gemma3TextScaledWordEmbedding: ModelOpt attaches no quantizer to it
    qk_norm=True,
    norms_per_layer=4,  # input, post-attention, pre- and post-feed-forward
    norm_offset=GEMMA_NORM,
    scaled_embedding=True,
)
