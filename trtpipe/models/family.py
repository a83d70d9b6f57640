"""What an architecture family declares: rules mapping HF tensors to TensorRT-LLM tensors, as data.

A :class:`Rule` names one TRT-LLM tensor, its HF sources (with their expected shapes in symbols of the
model's dimensions), how the sources combine (fusion) and how the result splits across ranks (TP plan).
Adding a family means writing one module of rules; ``trtpipe.checkpoint.convert`` never branches on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from trtpipe.models.dims import ModelDims

# Combine ops: how a rule's sources become one tensor.
#   one          a single source, renamed
#   cat          concatenate on dim 0 (q;k;v)
#   experts      stack the per-expert source over experts -> [E, ...]
#   experts_cat  stack each source over experts, then concatenate on dim -2 ([w3; w1] -> [E, 2I, H])
#   transposed   one fused [E, in, out] source (gpt-oss stores experts in -> out), transposed to [E, out, in]
#   gate_up_t    one fused gate/up source with gate and up interleaved (gpt-oss: gate = even, up = odd of the 2I
#                axis): [E, H, 2I] transposed to [E, 2I, H], or a [E, 2I] bias, then reordered to [up; gate]
#   mxfp4        (blocks, scales) of fused experts decoded to [E, out, in] (trtpipe.formats.mxfp4)
#   mxfp4_gate_up  the same, then the interleaved 2I rows reordered to [up; gate] as gate_up_t
COMBINES = ("one", "cat", "experts", "experts_cat", "transposed", "gate_up_t", "mxfp4", "mxfp4_gate_up")

# Split styles: how the unsharded TRT-LLM tensor is cut per rank (see trtpipe.checkpoint.shard).
#   replicate | column | row | qkv | vocab (lm_head) | embedding | moe_fc | moe_proj
SPLITS = ("replicate", "column", "row", "qkv", "vocab", "embedding", "moe_fc", "moe_proj")


LAYER_KINDS = ("all", "dense", "moe")


def always(info: ModelDims) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """One TRT-LLM tensor.

    Attributes:
        trt: TRT-LLM name; per-layer rules are relative to ``transformer.layers.{i}.``.
        hf: HF source names; per-layer ones relative to the family's HF layer prefix; ``{e}`` = expert.
        shapes: expected shape of each source, in symbols (``H`` hidden, ``Q`` heads*head_size, ``KV``
            kv_heads*head_size, ``D`` head_size, ``I`` intermediate, ``M`` one expert's intermediate, ``V`` vocab, ``E`` experts,
            ``NH`` heads, ``2M`` gate+up width, ``H/32`` and ``M/32`` MXFP4 groups, ``16`` bytes per MXFP4 group).
        split: split style (``SPLITS``).
        combine: combine op (``COMBINES``).
        when: the rule applies to this model (e.g. biases only when config.json says so).
        dtype: force this dtype instead of the model dtype (the MoE router stays float32).
        layers: which decoder layers hold the tensor: ``all``, or ``dense`` / ``moe`` where a model mixes dense-MLP
            and MoE layers (DeepSeek-V3's ``first_k_dense_replace``; :meth:`ModelDims.is_moe_layer`), so a dense
            layer's ``mlp.fc`` and an MoE layer's may be split differently.
        offset: added to the (combined) source in float32 before the cast to the checkpoint dtype, and
            subtracted when a checkpoint is turned back into HF names: Gemma's zero-centred norms store
            ``w`` for a scale of ``1 + w``, and TensorRT-LLM's Gemma checkpoints hold ``1 + w``.
    """

    trt: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[str, ...], ...]
    split: str
    combine: str = "one"
    when: Callable[[ModelDims], bool] = always
    dtype: Optional[str] = None
    offset: float = 0.0
    layers: str = "all"

    def __post_init__(self):
        assert self.combine in COMBINES and self.split in SPLITS, self
        assert len(self.hf) == len(self.shapes), self
        assert self.layers in LAYER_KINDS, self

    def at(self, info: ModelDims, layer: Optional[int] = None) -> bool:
        """The rule applies to this model (``when``) and, for a decoder layer, to that layer (``layers``)."""
        if not self.when(info):
            return False
        if layer is None or self.layers == "all":
            return True
        return info.is_moe_layer(layer) == (self.layers == "moe")


@dataclass(frozen=True)
class Family:
    """An architecture family: its rules and the config.json fields it adds.

    Attributes:
        name: short name (``llama``).
        architectures: HF ``architectures[0]`` values handled (``MistralForCausalLM`` shares Llama's rules).
        global_rules: embedding, final norm, lm_head (names are full).
        layer_rules: per-layer rules.
        hf_layer_prefix: where an HF layer's tensors live, ``{}`` = layer index.
        ignored: HF suffixes that carry no weights (e.g. rotary caches); any other unused tensor is an error.
        ignored_prefixes: HF name prefixes of towers trtpipe does not build (a multimodal checkpoint's vision
            tower and projector); their tensors are skipped, not an error.
        config_fields: ModelDims -> extra config.json fields of this family.
        unsupported: ModelDims -> (config.json key, why) for each setting this family cannot honour; ``trtpipe
            validate`` reports them before any weight is read.
        kept_unquantized: fnmatch patterns of TensorRT-LLM module names that quantization never touches, whatever the
            recipe says (gpt-oss's fused experts: the llmapi export keeps them as the source holds them, so the
            accuracy gate must measure them that way too).
        no_engine: why TensorRT-LLM has no TensorRT engine for this family ("" when it has one): ``trtpipe validate``
            refuses ``target: engine`` with it and names ``target: llmapi``.
        parallel_embedding_at_tp: TensorRT-LLM's config class of this family sets ``use_parallel_embedding`` to
            ``tp_size > 1`` whatever the checkpoint says (Gemma), so the checkpoint must hold the embedding
            vocab-sharded (dim 0) whenever tp > 1.
        llmapi_vocab_parallel: TensorRT-LLM's PyTorch-backend model of this family holds the embedding split
            across the tp ranks when attention data parallelism is off (``Embedding(...,
            tensor_parallel_mode=TensorParallelMode.COLUMN)``): what ``trtpipe plan`` counts per GPU for
            ``target: llmapi``.
        llmapi_router_in_model_dtype: that model keeps the MoE router weight in the model dtype (the engine path
            keeps it float32).
        embedding_in_exclude_modules: the unified HF export lists the embedding module in ``exclude_modules``, as
            ModelOpt 0.47.0 does for a plain ``nn.Embedding``: it lists a module only when it carries a (disabled)
            quantizer, and its quantizer registry takes an ``nn.Embedding`` subclass only when the subclass keeps
            ``nn.Embedding.forward`` (``modelopt/torch/opt/dynamic.py`` ``_DMRegistryCls._get_registered_nn_class``;
            ``modelopt/torch/export/quant_utils.py`` ``get_quant_config``). Gemma's
            ``Gemma3TextScaledWordEmbedding`` has a forward of its own (it multiplies by the embedding scale), so
            ModelOpt lists only ``lm_head`` for Gemma 3.
        no_recipe_quantization: why a recipe may not quantize this family (``quantization.algo`` / ``kv_cache``
            other than none) — "" when it may; ``trtpipe validate`` refuses it with this reason.
        shipped_quantization: the ``quantization_config.quant_method`` values whose quantized modules this family
            keeps exactly as shipped (gpt-oss's MXFP4 experts, see ``kept_unquantized``): a recipe may then quantize
            the rest (e.g. FP8 attention) without quantizing anything twice.

    Behaviour (what the layers do beyond Llama's; :func:`num_params` counts by it):
        qk_norm: a per-head RMSNorm of q and of k (head_dim weights each) before RoPE (Qwen3, Gemma 3).
        norms_per_layer: RMSNorms per decoder layer besides the q/k norms (Gemma 3: 4, pre/post feed-forward too).
        biased_moe: q/k/v/o, router and per-expert biases (gpt-oss).
        attention_sinks: one learned softmax logit per query head (gpt-oss).
        norm_offset: an RMSNorm scales by ``norm_offset + w`` (Gemma's zero-centred norms: 1; the rules' ``offset``
            stores them as TensorRT-LLM does, the synthetic builder draws ``w`` around ``1 - norm_offset``).
        scaled_embedding: the embedding output is multiplied by sqrt(hidden) rounded to the weight dtype (Gemma).
    """

    name: str
    architectures: tuple[str, ...]
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]
    hf_layer_prefix: str = "model.layers.{}."
    ignored: tuple[str, ...] = ("rotary_emb.inv_freq",)
    ignored_prefixes: tuple[str, ...] = ()
    config_fields: Callable[[ModelDims], dict] = field(default=lambda info: {})
    unsupported: Callable[[ModelDims], Iterable[tuple[str, str]]] = field(default=lambda info: ())
    parallel_embedding_at_tp: bool = False
    no_engine: str = ""
    kept_unquantized: tuple[str, ...] = ()
    llmapi_vocab_parallel: bool = False
    llmapi_router_in_model_dtype: bool = False
    embedding_in_exclude_modules: bool = True
    shipped_quantization: tuple[str, ...] = ()
    no_recipe_quantization: str = ""
    qk_norm: bool = False
    norms_per_layer: int = 2
    biased_moe: bool = False
    attention_sinks: bool = False
    norm_offset: float = 0.0
    scaled_embedding: bool = False


def shape_symbols(info: ModelDims) -> dict[str, int]:
    """Values of the shape symbols for one model."""
    return {
        "H": info.hidden_size,
        "Q": info.num_heads * info.head_dim,
        "KV": info.num_kv_heads * info.head_dim,
        "D": info.head_dim,
        "I": info.intermediate_size,
        "M": info.expert_intermediate_size,
        "V": info.vocab_size,
        "E": info.num_experts,
        "NH": info.num_heads,
        "2M": 2 * info.expert_intermediate_size,
        "H/32": info.hidden_size // 32,
        "M/32": info.expert_intermediate_size // 32,
        "16": 16,
        **mla_symbols(info),
    }


def mla_symbols(info: ModelDims) -> dict[str, int]:
    """MLA shape symbols (DeepSeek-V3): ``QA`` q_lora_rank, ``KVA`` kv_lora_rank + qk_rope_head_dim (the latent and
    the rope key), ``KVL`` kv_lora_rank, ``QB`` heads * (nope + rope), ``KVB`` heads * (nope + v), ``O`` heads * v,
    ``S`` the shared experts' width (moe_intermediate_size * n_shared_experts)."""
    a = info.mla
    if a is None:
        return {}
    return {
        "QA": a.q_lora_rank,
        "KVA": a.kv_values_per_token,
        "KVL": a.kv_lora_rank,
        "QB": info.num_heads * a.qk_head_dim,
        "KVB": info.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
        "O": info.num_heads * a.v_head_dim,
        "S": info.expert_intermediate_size * info.shared_experts,
    }


def num_params(info: ModelDims, family: Family) -> int:
    """Parameter count from the shapes and the family's behaviour (no weights read)."""
    if info.mla is not None:
        return _mla_params(info)
    h, i, d = info.hidden_size, info.intermediate_size, info.head_dim
    attn = h * (info.num_heads * d) + 2 * h * (info.num_kv_heads * d) + (info.num_heads * d) * h
    if info.is_moe:
        mlp = 3 * h * info.expert_intermediate_size * info.num_experts + h * info.num_experts
    else:
        mlp = 3 * h * i
    per_layer = attn + mlp + family.norms_per_layer * h + (2 * d if family.qk_norm else 0)
    if family.biased_moe:  # q/k/v/o, router and expert biases
        per_layer += (info.num_heads + 2 * info.num_kv_heads) * d + h
        per_layer += info.num_experts * (1 + 2 * info.expert_intermediate_size + h)
    if family.attention_sinks:
        per_layer += info.num_heads
    embed = info.vocab_size * h * (1 if info.tie_word_embeddings else 2)
    return info.num_layers * per_layer + embed + h


def _mla_params(info: ModelDims) -> int:
    """DeepSeek-V3: MLA attention, dense MLPs in the first layers, routed + shared experts and a router with its
    score-correction bias in the others; MTP layers are not counted (they are not part of the decoder)."""
    h, a, y = info.hidden_size, info.mla, mla_symbols(info)
    q = h * y["QB"] if not a.q_lora_rank else h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * y["QB"]
    attn = q + h * y["KVA"] + a.kv_lora_rank + a.kv_lora_rank * y["KVB"] + y["O"] * h
    m = info.expert_intermediate_size
    moe = 3 * h * m * info.num_experts + h * info.num_experts + info.num_experts + 3 * h * y["S"]
    layers = sum(moe if info.is_moe_layer(i) else 3 * h * info.intermediate_size for i in range(info.num_layers))
    embed = info.vocab_size * h * (1 if info.tie_word_embeddings else 2)
    return layers + info.num_layers * (attn + 2 * h) + embed + h
