"""How Hugging Face ``config.json`` files lay out what :mod:`trtpipe.models.dims` parses (one record, there).

Handles both rope layouts: transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters``, which may hold ``rope_theta`` and the scaling keys together, or, for models whose layers
differ (Gemma 3), one such dict per layer type: ``{"sliding_attention": {...}, "full_attention": {...}}``).

A multimodal ``*ForConditionalGeneration`` config (Gemma 3) is read through its ``text_config``: the language
model is what trtpipe builds. Hub text configs omit what equals the transformers defaults, so those defaults
(``TEXT_CONFIG_DEFAULTS``, from transformers ``models/gemma3/configuration_gemma3.py`` ``Gemma3TextConfig``) fill
the keys the file does not set.
"""

from __future__ import annotations

from typing import Any, Optional

# model_type -> the transformers defaults of the keys its published configs may omit (transformers 5.24
# Gemma3TextConfig; rope_theta 1e6 for global layers, rope_local_base_freq 1e4 for sliding ones).
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "attention_bias": False,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    },
}


def nested_rope(cfg: dict) -> Optional[dict]:
    """transformers 5's per-layer-type ``rope_parameters`` ({"full_attention": {...}, ...}), or None."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return params
    return None


def rope_of(cfg: dict, layer_type: str = "full_attention") -> tuple[Optional[float], Optional[dict]]:
    """(theta, scaling) of one layer type. Per-layer-type nesting: that type's entry (``full_attention`` is the
    global rope); without nesting, the transformers-4 keys (``rope_local_base_freq`` for sliding layers, unscaled,
    as Gemma 3's ``rope_local_base_freq`` is)."""
    params = cfg.get("rope_parameters")
    theta = cfg.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    nested = nested_rope(cfg)
    if nested is not None:
        params = nested.get(layer_type) or nested.get("full_attention") or next(iter(nested.values()))
        scaling = None
        theta = cfg.get("rope_local_base_freq", theta) if layer_type == "sliding_attention" else theta
    elif layer_type == "sliding_attention":
        return (None if cfg.get("rope_local_base_freq") is None else float(cfg["rope_local_base_freq"])), None
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        kind = rest.get("rope_type", rest.get("type"))
        if kind and kind != "default":
            scaling = rest
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
    return (None if theta is None else float(theta)), scaling


def text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(the language model's config, the prefix of its tensors): a multimodal ConditionalGeneration config is
    read through its ``text_config`` (its top-level ``architectures`` kept: it names the checkpoint's layout);
    the defaults of ``TEXT_CONFIG_DEFAULTS`` fill what the file omits."""
    prefix = ""
    if isinstance(cfg.get("text_config"), dict):
        top = cfg
        cfg = dict(top["text_config"])
        cfg["architectures"] = top.get("architectures") or cfg.get("architectures")
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in top and key not in cfg:
                cfg[key] = top[key]
        cfg.setdefault("model_type", f"{top.get('model_type', '')}_text")
        prefix = "language_model."  # what transformers' save_pretrained writes (language_model.model.*)
    for key, value in TEXT_CONFIG_DEFAULTS.get(str(cfg.get("model_type", "")), {}).items():
        cfg.setdefault(key, value)
    return cfg, prefix


def layer_types_of(cfg: dict, num_layers: int) -> tuple[str, ...]:
    """``layer_types`` (transformers 5) or Gemma's ``sliding_window_pattern`` (4.x: layer i global iff (i+1) % n == 0)."""
    if isinstance(cfg.get("layer_types"), list):
        return tuple(str(t) for t in cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern"))
    if isinstance(pattern, int) and pattern > 0:
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers))
    return ()
