"""Small random Hugging Face checkpoints, made offline with the real transformers classes (for tests).

``make_synthetic("llama3", out_dir)`` writes ``config.json`` + safetensors (optionally sharded with
``model.safetensors.index.json``) that ``AutoModelForCausalLM.from_pretrained`` loads. Weights are
re-drawn at a scale (~1/sqrt(fan_in), norms around 1) that gives well-separated logits, so greedy
continuations are not decided by float noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

from trtpipe.models import REGISTRY
from trtpipe.jsonfile import load_json

# DeepSeek-V3's ratios shrunk (hidden 7168 -> 64): MLA head dims nope 128 / rope 64 / v 128 -> 8 / 4 / 8 and the
# latent kv_lora_rank 512 (4 x nope) -> 32, q_lora_rank 1536 -> 24 (both narrower than hidden), 128 heads -> 4;
# 61 layers of which the first 3 dense -> 3 with the first 1 dense; 256 routed experts in 8 groups, 4 groups kept,
# top-8 -> 16 in 4 groups, 2 kept, top-4 (the choice still crosses groups); expert width 2048 -> 16, the dense
# MLP's 18432 -> 160, one shared expert; routed_scaling_factor 2.5, norm_topk_prob, sigmoid scores; YaRN factor 40
# over 4096 original positions (mscale = mscale_all_dim = 1, so the attention scale is (0.1 ln 40 + 1)^2 / sqrt(12))
# -> factor 40 over 64; rope_theta 10000, interleaved rope pairs, untied, eps 1e-6.
_DEEPSEEK_V3 = dict(
    hidden_size=64,
    intermediate_size=160,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    vocab_size=250,
    max_position_embeddings=2560,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


# kind -> (transformers config class name, model class name, config kwargs)
SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=250,
            max_position_embeddings=256,
            rope_theta=10000.0,
        ),
    ),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=250,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=250,
            max_position_embeddings=256,
            sliding_window=8,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=250,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-4B's ratios shrunk: 32 heads / 8 KV heads -> 8 / 2, head_dim 128 with hidden 2560 (q wider than hidden)
    # -> head_dim 16 with hidden 64 (q width 128), tied embeddings as in 0.6B-4B, rope_theta 1e6, eps 1e-6.
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=250,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-30B-A3B's ratios shrunk: 32 heads / 4 KV heads -> 8 / 2, head_dim 128 with hidden 2048 -> 16 with 64
    # (q wider than hidden), 128 experts top-8 -> 8 top-2, expert width 768 (3/8 of hidden) -> 32 (1/2: the smallest
    # that AWQ's group 32 divides); norm_topk_prob true as released; the dense intermediate_size no layer uses.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=192,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            vocab_size=250,
            max_position_embeddings=256,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # gemma-3-27b's ratios shrunk: 62 layers -> 6 (the 5:1 sliding/global pattern once: layer 5 global), 32 heads /
    # 16 KV heads -> 4 / 2, head_dim 128 with hidden 5376 (heads*head_dim 4096 narrower than hidden) -> 12 with 64
    # (48), query_pre_attn_scalar = hidden/heads (168) -> 16 (not head_dim), window 1024 -> 5 (shorter than the
    # tests' 12-token prompts), linear rope factor 8 on global layers, rope_local_base_freq 1e4, tied, eps 1e-6.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            query_pre_attn_scalar=16,
            sliding_window=5,
            vocab_size=250,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    # gpt-oss-20b's ratios shrunk: 24 layers -> 4 (sliding, full, sliding, full as layer_types alternate), 64 heads /
    # 8 KV heads -> 16 / 2, head_dim 64 with hidden 2880 (q 1.42x wider than hidden) -> 8 with 64 (2x), 32 experts
    # top-4 -> 8 top-2, expert width = hidden (2880 = 90 MXFP4 groups) -> 64 (2 groups), window 128 -> 4 (shorter
    # than the tests' prompts), YaRN factor 32 with beta 32/1 and truncate false as published, its original context
    # 4096 -> 1024: with 8 rotary dims the correction range is then (0.55, 1.71), so one frequency lies inside the ramp
    # and truncate: true would move it (as 4096 does with 64 dims: (8.1, 17.4)); max positions 131072 -> 32768
    # (1024 x 32), rope_theta 150000, eps 1e-5, untied; swiglu_limit 7 -> 2: the tiny model's
    # pre-activations rarely reach 7, at 2 the clamp acts on a good share of them (the parity tests need it to).
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=4,
            vocab_size=250,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            swiglu_limit=2.0,
            attention_bias=True,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 1024,
            },
        ),
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK_V3),
    # Kimi-K2's configuration (DeepseekV3ForCausalLM with half DeepSeek-V3's heads, 384 routed experts in one group,
    # routed_scaling_factor 2.827, one dense layer, rope_theta 50000, YaRN factor 32 over 4096; values as recalled
    # from moonshotai/Kimi-K2-Instruct's config.json, not checked against the hub file here) shrunk as "deepseek_v3":
    # heads 4 -> 2, 24 routed experts in 1 group, top-4.
    "kimi_k2": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_DEEPSEEK_V3,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "n_routed_experts": 24,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.827,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                **_DEEPSEEK_V3["rope_parameters"],
                "rope_theta": 50000.0,
                "factor": 32.0,
                "beta_fast": 1.0,
            },
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=250,
            max_position_embeddings=256,
        ),
    ),
}


def _reinit(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    # a family whose RMSNorm scales by (norm_offset + w) gets norm weights around 1 - norm_offset: a scale around 1
    family = REGISTRY.get(type(model).__name__)
    centre = 1.0 - (family.norm_offset if family else 0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(centre + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):  # gpt-oss: sink logits on the scale of the scores, so they take real mass
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _draw_buffers(model: torch.nn.Module, seed: int) -> None:
    """Saved buffers that are weights (DeepSeek-V3's ``e_score_correction_bias``, zero at init): drawn on the scale of
    the sigmoid scores they shift, so the expert choice differs from the unbiased one's."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _to_v4_rope(path: Path) -> None:
    """Rewrite config.json's rope settings in the transformers-4 form (rope_theta + rope_scaling)."""
    cfg = load_json(path)
    params = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = params.pop("rope_theta", 10000.0)
    if params.get("rope_type", "default") != "default":
        params["type"] = params["rope_type"]
        cfg["rope_scaling"] = params
    path.write_text(json.dumps(cfg, indent=2))


def make_synthetic(
    kind: str,
    out_dir: str | Path,
    seed: int = 0,
    shard_bytes: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    rope_layout: str = "v5",
    **overrides,
) -> Path:
    """Write a random HF checkpoint of family ``kind`` (``SPECS``) to ``out_dir`` and return it.

    Args:
        shard_bytes: split the weights into files of about this size (writes the index json).
        rope_layout: ``v5`` (rope_parameters, as transformers 5 saves) or ``v4`` (rope_theta + rope_scaling).
        overrides: config fields to change (e.g. ``num_hidden_layers=3``).
    """
    import transformers

    if kind == "gpt_oss_mxfp4":
        return _make_gpt_oss_mxfp4(out_dir, seed, overrides)
    cfg_name, model_name, kwargs = SPECS["gemma3" if kind == "gemma3_multimodal" else kind]
    kwargs = {**kwargs, **overrides}
    if kind == "gemma3_multimodal":
        return _make_gemma3_multimodal(out_dir, seed, dtype, overrides)
    if "rope_theta" in kwargs and "rope_parameters" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _reinit(model, seed)
    _draw_buffers(model, seed)
    model = model.to(dtype).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(out_dir, **save_kwargs)
    if rope_layout == "v4":
        _to_v4_rope(out_dir / "config.json")
    return out_dir


def _make_gemma3_multimodal(out_dir, seed: int, dtype: torch.dtype, overrides: dict) -> Path:
    """A ``Gemma3ForConditionalGeneration``: the "gemma3" text model plus a one-layer SigLIP tower (28x28 images,
    patch 14, 4 tokens per image). save_pretrained writes the text model as ``language_model.model.*``."""
    import transformers

    _, _, text = SPECS["gemma3"]
    text_config = transformers.Gemma3TextConfig(**{**text, **overrides})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text_config.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _reinit(model, seed)
    model = model.to(dtype).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


# gpt-oss's hub quantization_config (openai/gpt-oss-20b and -120b config.json)
GPT_OSS_MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def _make_gpt_oss_mxfp4(out_dir, seed: int, overrides: dict) -> Path:
    """The "gpt_oss" model with its experts stored as the hub checkpoints store them: ``gate_up_proj_blocks`` /
    ``_scales`` [E, 2I, H/32, 16] / [E, 2I, H/32] (rows gate/up interleaved) and ``down_proj_blocks`` / ``_scales``
    [E, H, I/32, 16] / [E, H, I/32] in place of the bf16 ``gate_up_proj`` [E, H, 2I] / ``down_proj`` [E, I, H], and
    the hub ``quantization_config``. Biases and every other tensor stay float32."""
    from safetensors.torch import load_file, save_file

    from trtpipe.formats import mxfp4

    out_dir = make_synthetic("gpt_oss", out_dir, seed=seed, **overrides)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))  # [E, out, in]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg_path = out_dir / "config.json"
    cfg = load_json(cfg_path)
    cfg["quantization_config"] = GPT_OSS_MXFP4_CONFIG
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out_dir


def load_hf(model_dir: str | Path) -> torch.nn.Module:
    """The HF reference model in float32 eval mode (the oracle for parity tests)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False).eval()
