"""ModelDims (trtpipe/models/dims.py) is the one reader of a model's dimensions: it parses every family's real
config.json (recipes/configs/) and the synthetic builders' configs, and the planner, the predictor and the reference
runtime read the very same values from it, also through the TensorRT-LLM checkpoint config the converter writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtpipe.engine.planner import Shapes
from trtpipe.errors import CheckpointError
from trtpipe.models import FAMILIES, get_family, num_params
from trtpipe.models.dims import ModelDims, checkpoint_dims, parse_hf_config
from trtpipe.models.synthetic import SPECS
from trtpipe.models.trtllm_config import build_config
from trtpipe.perf.models import PARSERS, model_spec, spec_of
from trtpipe.runtime.model import ModelArgs

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
# target models only: a speculative draft head (LlamaForCausalLMEagle3) is not a model family and has its own test
SHIPPED = sorted(
    p.parent.name
    for p in CONFIGS.glob("*/config.json")
    if not json.loads(p.read_text())["architectures"][0].endswith("Eagle3")
)


def synthetic_config(kind: str) -> dict:
    """The config.json a synthetic builder writes (transformers' own config class), without drawing weights."""
    import transformers

    cfg_name, model_name, kwargs = SPECS[kind]
    cfg = getattr(transformers, cfg_name)(**kwargs).to_dict()
    cfg["architectures"] = [model_name]
    return cfg


def all_configs() -> list[tuple[str, dict]]:
    shipped = [(d, json.loads((CONFIGS / d / "config.json").read_text())) for d in SHIPPED]
    return shipped + [(f"synthetic:{k}", synthetic_config(k)) for k in sorted(SPECS)]


CASES = all_configs()


def test_every_family_has_a_real_and_a_synthetic_config():
    archs = {parse_hf_config(cfg).architecture for _, cfg in CASES}
    for family in FAMILIES:
        assert set(family.architectures) & archs, family.name


@pytest.mark.parametrize("name,cfg", CASES, ids=[n for n, _ in CASES])
def test_parsed_dimensions_are_the_file_s(name, cfg):
    d = parse_hf_config(cfg)
    text = cfg.get("text_config") or cfg
    assert d.hidden_size == text["hidden_size"] and d.num_layers == text["num_hidden_layers"]
    assert d.num_heads == text["num_attention_heads"]
    assert d.num_kv_heads == text.get("num_key_value_heads", d.num_heads)
    if d.mla is not None:  # MLA: q/k heads are nope + rope wide; a saved DeepseekV3Config's head_dim is the rope part
        assert (d.head_dim, d.rotary_dim) == (
            text["qk_nope_head_dim"] + text["qk_rope_head_dim"],
            text["qk_rope_head_dim"],
        )
    else:
        assert d.head_dim == (text.get("head_dim") or d.hidden_size // d.num_heads)
    assert d.num_experts == (
        text.get("num_local_experts") or text.get("num_experts") or text.get("n_routed_experts") or 0
    )
    assert d.expert_intermediate_size == (text.get("moe_intermediate_size") or text["intermediate_size"])
    if d.layer_types:
        assert len(d.layer_types) == d.num_layers
    if "sliding_attention" in d.layer_types:
        assert d.sliding_window
    assert d.rotary_dim == (d.mla.qk_rope_head_dim if d.mla else d.head_dim)  # MLA rotates the rope part only


@pytest.mark.parametrize("name,cfg", CASES, ids=[n for n, _ in CASES])
def test_planner_predictor_and_runtime_read_the_same_dimensions(name, cfg):
    d = parse_hf_config(cfg)
    ckpt = build_config(d, get_family(d.architecture), "bfloat16", tp=2)
    back = checkpoint_dims(ckpt)  # the runtime's and the planner's view: the TensorRT-LLM checkpoint config
    same = (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "num_experts",
        "experts_per_token",
        "expert_intermediate_size",
        "sliding_window",
        "layer_types",
        "rope_theta",
        "rope_local_theta",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "moe_renormalize",
        "query_pre_attn_scalar",
        "swiglu_limit",
        "attention_sinks",
        "rotary_dim",
    )
    assert {k: getattr(back, k) for k in same if k != "layer_types"} == {
        k: getattr(d, k) for k in same if k != "layer_types"
    }
    mixed = d.layer_types if "sliding_attention" in d.layer_types else ()  # all full_attention is not written
    assert back.layer_types == mixed

    s = Shapes.of(ckpt)
    assert (
        s.hidden,
        s.layers,
        s.heads,
        s.kv_heads,
        s.head_size,
        s.intermediate,
        s.vocab,
        s.experts,
        s.top_k,
        s.sliding_window,
        s.layer_types,
    ) == (
        d.hidden_size,
        d.num_layers,
        d.num_heads,
        d.num_kv_heads,
        d.head_dim,
        d.expert_intermediate_size,
        d.vocab_size,
        d.num_experts,
        d.experts_per_token,
        d.sliding_window,
        mixed,
    )

    a = ModelArgs.from_config(ckpt)
    assert (
        a.hidden_size,
        a.num_layers,
        a.num_heads,
        a.num_kv_heads,
        a.head_size,
        a.vocab_size,
        a.layer_types,
        a.sliding_window,
        a.rotary_base,
        a.norm_epsilon,
        a.tp,
    ) == (
        d.hidden_size,
        d.num_layers,
        d.num_heads,
        d.num_kv_heads,
        d.head_dim,
        d.vocab_size,
        mixed,
        d.sliding_window,
        d.rope_theta,
        d.rms_norm_eps,
        2,
    )
    assert a.num_experts == (d.num_experts if d.is_moe else 0) and a.top_k == d.experts_per_token

    if d.model_type in PARSERS:
        spec = model_spec(d, name)
        assert (spec.hidden, spec.vocab, spec.heads, spec.kv_heads, spec.num_layers) == (
            d.hidden_size,
            d.vocab_size,
            d.num_heads,
            1 if d.mla else d.num_kv_heads,  # MLA: one latent shared by all heads
            d.num_layers,
        )
        assert spec.kv_elems == (d.mla.kv_values_per_token if d.mla else 2 * d.num_kv_heads * d.head_dim)
        assert spec_of(d.raw, name) == spec  # the dict entry point parses through the same record


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_parameter_count_follows_the_family_behaviour(kind):
    """num_params (families' qk_norm / norms_per_layer / biased_moe / attention_sinks) counts what transformers
    builds. Qwen2's q/k/v biases are left out of the count (3 x 64 + ... per layer: known, small)."""
    import torch
    import transformers

    cfg_name, model_name, kwargs = SPECS[kind]
    with torch.device("meta"):
        model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kwargs))
    d = parse_hf_config(synthetic_config(kind))
    counted = sum(p.numel() for p in model.parameters())  # a tied weight once, as num_params counts it
    # DeepSeek-V3's score-correction bias is a buffer in transformers and a stored tensor of the checkpoint
    counted += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    bias = 0
    if kind == "qwen2":
        bias = d.num_layers * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
    assert num_params(d) == counted - bias


def test_model_types_name_facts_their_own_way():
    gptj = parse_hf_config(
        {"model_type": "gptj", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": None, "vocab_size": 100}, required=()
    )
    assert (gptj.hidden_size, gptj.num_layers, gptj.num_heads, gptj.intermediate_size) == (64, 3, 4, 256)
    falcon = parse_hf_config(
        {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10},
        required=(),
    )
    assert (falcon.num_kv_heads, falcon.tie_word_embeddings, falcon.intermediate_size) == (1, True, 256)
    with pytest.raises(CheckpointError, match="required key 'n_embd' is missing"):
        parse_hf_config({"model_type": "gptj", "n_layer": 3, "n_head": 4, "vocab_size": 100}, required=())
    with pytest.raises(CheckpointError, match="required key 'architectures' is missing"):
        parse_hf_config(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 96,
                "vocab_size": 10,
            }
        )


def test_checkpoint_view_fills_tensorrt_llm_defaults():
    d = checkpoint_dims(
        {
            "architecture": "LlamaForCausalLM",
            "dtype": "float16",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 10,
            "moe": {"num_experts": 4, "top_k": 2, "normalization_mode": 0},
        }
    )
    assert isinstance(d, ModelDims)
    assert (d.intermediate_size, d.num_kv_heads, d.head_dim, d.torch_dtype) == (256, 4, 16, "float16")
    assert (d.num_experts, d.experts_per_token, d.moe_renormalize) == (4, 2, False)


@pytest.mark.parametrize("kind,centre", [("gemma3", 0.0), ("qwen3", 1.0)])
def test_synthetic_norms_are_drawn_around_the_family_s_unit_scale(kind, centre, tmp_path):
    """Family.norm_offset (Gemma: a norm scales by 1 + w) decides where the synthetic builder draws norm weights."""
    from safetensors.torch import load_file

    from trtpipe.models.synthetic import make_synthetic

    tensors = load_file(str(make_synthetic(kind, tmp_path) / "model.safetensors"))
    norms = [t for n, t in tensors.items() if n.endswith("input_layernorm.weight")]
    assert abs(float(sum(t.mean() for t in norms)) / len(norms) - centre) < 0.1
