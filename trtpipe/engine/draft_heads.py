"""The bytes of a published EAGLE-3 draft head, from its config.json alone (a head not on this disk); and of an
EAGLE-1/2 head as the engine path holds it (:func:`eagle1_engine_params`).

A ``LlamaForCausalLMEagle3`` head as TensorRT-LLM's PyTorch backend builds it (``Eagle3LlamaDraftModel`` and
``Eagle3LlamaForCausalLM``, ``tensorrt_llm/_torch/models/modeling_speculative.py``; the revisions the code index
holds differ only in ``d2t``'s integer width, int64 or int32, counted here as int64):
- ``fc``: the three captured target hidden states (3 x ``target_hidden_size``, default ``hidden_size``) to
  ``hidden_size``, no bias;
- ``midlayer``: one Llama decoder layer whose q/k/v projections read 2 x ``hidden_size`` (the token's embedding
  and the fused hidden state side by side), an ``o_proj``, a gated MLP of ``intermediate_size`` and three RMSNorms
  (``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``);
- ``norm``, an ``lm_head`` over ``draft_vocab_size`` rows and ``d2t`` (draft -> target token ids, when the draft
  vocabulary is smaller);
- the embedding is the target's (only a head whose hidden size differs from the target's has its own).
Weights in the config's ``torch_dtype`` (2 bytes for float16 / bfloat16).
"""

from __future__ import annotations

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
D2T_BYTES = 8  # int64 per draft token id


def is_eagle3_head(cfg: dict) -> bool:
    return any("Eagle3" in a for a in cfg.get("architectures") or ())


def eagle3_head_params(cfg: dict) -> dict[str, int]:
    """Parameter count of each part of the head (unsharded)."""
    h = int(cfg["hidden_size"])
    h_in = int(cfg.get("target_hidden_size") or h)
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    d = int(cfg.get("head_dim") or h // heads)
    vocab = int(cfg["vocab_size"])
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    parts = {
        "fc": 3 * h_in * h,
        "midlayer.self_attn": 2 * h * (heads + 2 * kv) * d + heads * d * h,
        "midlayer.mlp": 3 * h * int(cfg["intermediate_size"]),
        "norms": 4 * h,
        "lm_head": draft_vocab * h,
    }
    if h_in != h:
        parts["embed_tokens"] = vocab * h
    return parts


def eagle3_head_bytes(cfg: dict) -> int:
    """Bytes the head's weights take (all ranks together), ``d2t`` included."""
    per = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    vocab = int(cfg["vocab_size"])
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    return per * sum(eagle3_head_params(cfg).values()) + (D2T_BYTES * draft_vocab if draft_vocab != vocab else 0)


def eagle1_engine_params(cfg: dict, num_eagle_layers: int) -> dict[str, int]:
    """Parameter count of an EAGLE-1/2 head as an ``EagleForCausalLM`` engine holds it (unsharded): one EagleNet per
    eagle layer, each a full copy (``load_eagle_hf`` writes ``eagle_nets.{i}`` for every ``i < num_eagle_layers``,
    "FIXME tensors are duplicated on disk", ``tensorrt_llm/models/eagle/weight.py@535c9cc6``) of
    - ``drafter.fc``: [hidden, 2 x hidden] and its bias,
    - ``drafter.layers``: Llama decoder layers (q/k/v/o, a gated MLP of ``intermediate_size``, ``post_layernorm``;
      ``input_layernorm`` on every layer but the first),
    - ``drafter.vocab_embedding`` and ``lm_head`` (the base model's, copied), ``vocab_size`` x hidden each."""
    h, vocab, n = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg.get("num_hidden_layers") or 1)
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    d = int(cfg.get("head_dim") or h // heads)
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * int(cfg["intermediate_size"]) + h
    net = {
        "fc": 2 * h * h + h,
        "layers": n * per_layer + (n - 1) * h,
        "vocab_embedding": vocab * h,
        "lm_head": vocab * h,
    }
    return {k: v * num_eagle_layers for k, v in net.items()}


def eagle1_engine_bytes(cfg: dict, num_eagle_layers: int) -> int:
    """Bytes of :func:`eagle1_engine_params` in the head config's ``torch_dtype`` (2 bytes unless float32)."""
    per = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), 2)
    return per * sum(eagle1_engine_params(cfg, num_eagle_layers).values())
