"""The published models' shapes, as their Hugging Face ``config.json`` files state them, and one reader for all.

``PUBLISHED`` holds, per model name used in NVIDIA's TensorRT-LLM performance tables, the Hugging Face repository
and the ``config.json`` fields the performance model needs (key names and values exactly as in that file; fields
that do not change a step's cost, such as rope settings or token ids, are left out). ``spec_of(config)`` turns any
such dict -- or a recipe's own config.json -- into a :class:`ModelSpec`: parameter counts per layer kind, KV bytes
per token, attention widths. The dimensions are :class:`~trtpipe.models.dims.ModelDims` (the one parser); per
``model_type`` a table row says how the layers group into kinds for the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from trtpipe.errors import CheckpointError, TrtpipeError
from trtpipe.models.dims import ModelDims, parse_hf_config

_LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
_LLAMA3_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}

# name in the published tables -> (Hugging Face repository, config.json facts)
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "GPT-J 6B": (
        "EleutherAI/gpt-j-6b",
        {
            "model_type": "gptj",
            "n_embd": 4096,
            "n_layer": 28,
            "n_head": 16,
            "n_inner": None,
            "rotary_dim": 64,
            "vocab_size": 50400,
            "tie_word_embeddings": False,
        },
    ),
    "Llama 2 7B": (
        "meta-llama/Llama-2-7b-hf",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
    ),
    "Llama 2 13B": (
        "meta-llama/Llama-2-13b-hf",
        {
            "model_type": "llama",
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 40,
            "intermediate_size": 13824,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
    ),
    "Llama 2 70B": (
        "meta-llama/Llama-2-70b-hf",
        {
            "model_type": "llama",
            "hidden_size": 8192,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 28672,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
    ),
    "Falcon 180B": (
        "tiiuae/falcon-180B",
        {
            "model_type": "falcon",
            "hidden_size": 14848,
            "num_hidden_layers": 80,
            "num_attention_heads": 232,
            "num_kv_heads": 8,
            "new_decoder_architecture": True,
            "parallel_attn": True,
            "vocab_size": 65024,
        },
    ),
    "Mistral 7B": (
        "mistralai/Mistral-7B-v0.1",
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 32000,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
        },
    ),
    "Mixtral 8x7B": (
        "mistralai/Mixtral-8x7B-v0.1",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
    ),
    "Mixtral 8x22B": (
        "mistralai/Mixtral-8x22B-Instruct-v0.1",
        {
            "model_type": "mixtral",
            "hidden_size": 6144,
            "num_hidden_layers": 56,
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "intermediate_size": 16384,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32768,
            "tie_word_embeddings": False,
        },
    ),
    "Llama 3 8B": ("meta-llama/Meta-Llama-3-8B", _LLAMA3_8B),
    "Llama 3.1 8B": ("meta-llama/Llama-3.1-8B-Instruct", _LLAMA3_8B),
    "Llama 3 70B": ("meta-llama/Meta-Llama-3-70B", _LLAMA3_70B),
    "Llama 3.1 70B": ("meta-llama/Llama-3.1-70B-Instruct", _LLAMA3_70B),
    "Llama 3.3 70B": ("meta-llama/Llama-3.3-70B-Instruct", _LLAMA3_70B),
    "Llama 3.1 405B": (
        "meta-llama/Llama-3.1-405B-Instruct",
        {
            "model_type": "llama",
            "hidden_size": 16384,
            "num_hidden_layers": 126,
            "num_attention_heads": 128,
            "num_key_value_heads": 8,
            "intermediate_size": 53248,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
        },
    ),
    "Llama 4 Scout": (
        "meta-llama/Llama-4-Scout-17B-16E-Instruct",
        {
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "hidden_size": 5120,
                "num_hidden_layers": 48,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "intermediate_size": 8192,
                "intermediate_size_mlp": 16384,
                "num_local_experts": 16,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 1,
                "vocab_size": 202048,
                "attention_chunk_size": 8192,
            },
        },
    ),
    "Llama 4 Maverick 17B-128E": (
        "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
        {
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "hidden_size": 5120,
                "num_hidden_layers": 48,
                "num_attention_heads": 40,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "intermediate_size": 8192,
                "intermediate_size_mlp": 16384,
                "num_local_experts": 128,
                "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2,
                "vocab_size": 202048,
                "attention_chunk_size": 8192,
            },
        },
    ),
    "Qwen3-30B-A3B": (
        "Qwen/Qwen3-30B-A3B",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
    "Qwen3-235B-A22B": (
        "Qwen/Qwen3-235B-A22B",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 4096,
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 1536,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
    ),
    "DeepSeek R1 0528": (
        "deepseek-ai/DeepSeek-R1-0528",
        {
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "vocab_size": 129280,
            "tie_word_embeddings": False,
        },
    ),
    "GPT-OSS 20B": (
        "openai/gpt-oss-20b",
        {
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 2880,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "vocab_size": 201088,
            "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "mxfp4"},
        },
    ),
    "GPT-OSS 120B": (
        "openai/gpt-oss-120b",
        {
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 2880,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "sliding_window": 128,
            "vocab_size": 201088,
            "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "mxfp4"},
        },
    ),
}


# The model cards' headline parameter counts (billions): (total, active per token, whether "active" counts the input
# embedding table). Not an input to the cost model -- a check that the parsers above read the configs right
# (tests/perf/test_model_facts.py). OpenAI's gpt-oss card counts the unembedding but not the embedding as active.
CARD_PARAMS_B: dict[str, tuple[float, float, bool]] = {
    "Mixtral 8x7B": (46.7, 12.9, True),
    "Mixtral 8x22B": (141.0, 39.0, True),
    "Llama 3.1 8B": (8.0, 8.0, True),
    "Llama 3.3 70B": (70.6, 70.6, True),
    "Llama 3.1 405B": (405.0, 405.0, True),
    "Llama 4 Scout": (109.0, 17.0, True),
    "Llama 4 Maverick 17B-128E": (400.0, 17.0, True),
    "Qwen3-30B-A3B": (30.5, 3.3, True),
    "Qwen3-235B-A22B": (235.0, 22.0, True),
    "DeepSeek R1 0528": (671.0, 37.0, True),
    "GPT-OSS 20B": (20.9, 3.61, False),
    "GPT-OSS 120B": (116.83, 5.13, False),
}


@dataclass(frozen=True)
class LayerKind:
    """``count`` identical decoder layers: attention params, dense-MLP params, and routed experts (if any)."""

    count: int
    attn_params: int  # q/k/v/o projections (incl. MLA down/up projections)
    mlp_params: int  # dense MLP, plus shared experts of an MoE layer
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0  # one routed expert
    window: int = 0  # sliding attention window (0: full attention)
    chunk: int = 0  # chunked local attention: each token attends only within its own chunk of this many positions


@dataclass(frozen=True)
class ModelSpec:
    """What a step's cost depends on. Parameter counts are unsharded; the cost model shards them."""

    name: str
    hidden: int
    vocab: int
    heads: int
    kv_heads: int  # KV heads that tp can split (1 for MLA: one latent shared by all heads)
    qk_dim: int  # per head, for attention FLOPs (MLA: the absorbed latent + rope width)
    v_dim: int
    kv_elems: int  # K+V elements one token stores per layer (whole model, one copy of each KV head)
    layers: tuple[LayerKind, ...]
    tied_embeddings: bool = False
    mxfp4_experts: bool = False  # experts shipped in MXFP4 whatever the run's precision label
    mla: bool = False  # multi-head latent attention (DeepSeek-V3): its generation attention runs as FlashMLA on SM 9.0

    @property
    def num_layers(self) -> int:
        return sum(k.count for k in self.layers)

    @property
    def is_moe(self) -> bool:
        return any(k.experts for k in self.layers)

    @property
    def total_params(self) -> int:
        body = sum(k.count * (k.attn_params + k.mlp_params + k.experts * k.expert_params) for k in self.layers)
        return body + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def active_params(self) -> int:
        body = sum(k.count * (k.attn_params + k.mlp_params + k.top_k * k.expert_params) for k in self.layers)
        return body + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)


def _gqa_attn(h: int, heads: int, kv: int, d: int) -> int:
    return h * (heads + 2 * kv) * d + heads * d * h


def _llama(m: ModelDims, name: str) -> ModelSpec:
    h, heads, kv, d = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    inter = m.expert_intermediate_size
    attn = _gqa_attn(h, heads, kv, d)
    window = int(m.sliding_window or 0)
    if m.num_experts:
        kind = LayerKind(m.num_layers, attn, 0, m.num_experts, m.experts_per_token, 3 * h * inter, window)
    else:
        kind = LayerKind(m.num_layers, attn, 3 * h * inter, window=window)
    return ModelSpec(name, h, m.vocab_size, heads, kv, d, d, 2 * kv * d, (kind,), m.tie_word_embeddings)


def _gptj(m: ModelDims, name: str) -> ModelSpec:
    h, heads = m.hidden_size, m.num_heads
    kind = LayerKind(m.num_layers, 4 * h * h, 2 * h * m.intermediate_size)
    return ModelSpec(name, h, m.vocab_size, heads, heads, h // heads, h // heads, 2 * h, (kind,))


def _falcon(m: ModelDims, name: str) -> ModelSpec:
    h, heads, kv = m.hidden_size, m.num_heads, m.num_kv_heads
    d = h // heads
    kind = LayerKind(m.num_layers, _gqa_attn(h, heads, kv, d), 2 * h * m.intermediate_size)
    return ModelSpec(name, h, m.vocab_size, heads, kv, d, d, 2 * kv * d, (kind,), m.tie_word_embeddings)


def _llama4(m: ModelDims, name: str) -> ModelSpec:
    """Layer i is MoE when (i + 1) % interleave_moe_layer_step == 0, and a no-RoPE layer (global attention) when
    (i + 1) % no_rope_layer_interval == 0 (transformers' Llama4TextConfig default: 4); the RoPE layers attend within
    chunks of ``attention_chunk_size`` (TensorRT-LLM's Llama4DecoderLayer passes the chunk to every RoPE layer's
    attention: NVIDIA/TensorRT-LLM@3a5901cd tensorrt_llm/_torch/models/modeling_llama.py)."""
    h, heads, kv, d = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = _gqa_attn(h, heads, kv, d)
    chunk, norope = m.attention_chunk, m.no_rope_layer_interval
    expert = 3 * h * m.moe_intermediate_size
    counts: dict[tuple[bool, bool], int] = {}
    for i in range(m.num_layers):
        key = (m.is_moe_layer(i), bool(chunk) and (i + 1) % norope != 0)  # (MoE, chunked)
        counts[key] = counts.get(key, 0) + 1
    kinds = []
    for (is_moe, chunked), count in sorted(counts.items(), reverse=True):
        if is_moe:  # the shared expert is a dense MLP beside the routed ones
            kind = LayerKind(count, attn, expert, m.num_experts, m.experts_per_token, expert)
        else:
            kind = LayerKind(count, attn, 3 * h * m.intermediate_size)
        kinds.append(replace(kind, chunk=chunk if chunked else 0))
    return ModelSpec(name, h, m.vocab_size, heads, kv, d, d, 2 * kv * d, tuple(kinds))


def _deepseek(m: ModelDims, name: str) -> ModelSpec:
    h, heads, a = m.hidden_size, m.num_heads, m.mla
    if a is None:
        raise TrtpipeError("config.json: 'kv_lora_rank' is missing (needed for the deepseek_v3 performance model)")
    qr, kvr, nope, rope, vd = a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
    attn = h * qr + qr * heads * (nope + rope) + h * (kvr + rope) + kvr * heads * (nope + vd) + heads * vd * h
    expert = 3 * h * m.moe_intermediate_size
    kinds = (
        LayerKind(m.dense_layers, attn, 3 * h * m.intermediate_size),
        LayerKind(
            m.num_layers - m.dense_layers, attn, m.shared_experts * expert, m.num_experts, m.experts_per_token, expert
        ),
    )
    # MLA caches one latent (kv_lora_rank + rope) per token per layer; decode attends in the latent space
    return ModelSpec(name, h, m.vocab_size, heads, 1, kvr + rope, kvr, kvr + rope, kinds, mla=True)


def _gpt_oss(m: ModelDims, name: str) -> ModelSpec:
    h, heads, kv, d = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    attn = _gqa_attn(h, heads, kv, d)
    n = m.num_layers
    expert = 3 * h * m.intermediate_size
    e, k = m.num_experts, m.experts_per_token
    kinds = (
        LayerKind(n // 2, attn, 0, e, k, expert, m.sliding_window or 0),
        LayerKind(n - n // 2, attn, 0, e, k, expert),
    )
    return ModelSpec(name, h, m.vocab_size, heads, kv, d, d, 2 * kv * d, kinds, mxfp4_experts=m.quant_method == "mxfp4")


# model_type -> how its layers group into kinds for the cost model (the dimensions come from ModelDims)
PARSERS: dict[str, Callable[[ModelDims, str], ModelSpec]] = {
    "llama": _llama,
    "mistral": _llama,
    "mixtral": _llama,
    "qwen2": _llama,
    "qwen3": _llama,
    "qwen3_moe": _llama,
    "gptj": _gptj,
    "falcon": _falcon,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "deepseek_v3": _deepseek,
    "gpt_oss": _gpt_oss,
}


def facts(spec: ModelSpec) -> dict:
    """One model's facts as the cost model sees them: parameters, experts, routing, layer types, KV per token."""
    moe = [k for k in spec.layers if k.experts]
    shared = [k.mlp_params // k.expert_params for k in moe if k.expert_params and k.mlp_params]
    kinds = []
    for k in spec.layers:
        kind = f"{k.count} x {'MoE' if k.experts else 'dense'}"
        kind += f" (sliding window {k.window})" if k.window else ""
        kind += f" (chunked attention {k.chunk})" if k.chunk else ""
        kinds.append(kind)
    return {
        "model": spec.name,
        "total_params_b": round(spec.total_params / 1e9, 2),
        "active_params_b": round(spec.active_params / 1e9, 2),
        "experts": moe[0].experts if moe else 0,
        "top_k": moe[0].top_k if moe else 0,
        "shared_experts": shared[0] if shared else 0,
        "attention": (
            "MLA (latent KV)"
            if spec.kv_heads == 1 and spec.qk_dim != spec.v_dim
            else f"GQA {spec.heads}/{spec.kv_heads}"
        ),
        "layers": " + ".join(kinds),
        "kv_elems_per_token_layer": spec.kv_elems,
        "mxfp4_experts": spec.mxfp4_experts,
    }


def facts_table() -> str:
    """:func:`facts` of every published model, as a markdown table (docs/reference/perf-model.md shows it)."""
    rows = [facts(published_spec(n)) for n in PUBLISHED]
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def spec_of(config: dict, name: str = "") -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config.json dict (or a published entry)."""
    mt = config.get("model_type")
    _check_model_type(mt)
    try:
        dims = parse_hf_config(config, required=())
    except CheckpointError as exc:
        raise TrtpipeError(f"{exc} (needed for the {mt} performance model)") from None
    return model_spec(dims, name or mt)


def model_spec(dims: ModelDims, name: str = "") -> ModelSpec:
    """A :class:`ModelSpec` from a model's parsed dimensions (``name`` defaults to its model_type)."""
    _check_model_type(dims.model_type)
    return PARSERS[dims.model_type](dims, name or dims.model_type)


def _check_model_type(mt) -> None:
    if mt not in PARSERS:
        raise TrtpipeError(
            f"config.json: model_type '{mt}' has no performance model (supported: {', '.join(sorted(PARSERS))})"
        )


def published_spec(name: str) -> ModelSpec:
    if name not in PUBLISHED:
        raise TrtpipeError(f"model '{name}' has no published config in trtpipe.perf.models.PUBLISHED")
    return spec_of(PUBLISHED[name][1], name)


if __name__ == "__main__":  # python -m trtpipe.perf.models: the facts table
    print(facts_table())
