"""Building blocks: a decoder layer from unsharded tensors (what calibration uses), rope tables, the linear registry."""

from __future__ import annotations

import pytest
import torch

from trtpipe.checkpoint.convert import make_plan, unsharded_layer
from trtpipe.checkpoint.hf import HFReader
from trtpipe.errors import CheckpointError
from trtpipe.models.trtllm_config import build_config
from trtpipe.runtime import DecoderLayer, ModelArgs
from trtpipe.runtime.linear import LinearSpec, build_linear, module_quant_algo
from trtpipe.runtime.rope import INV_FREQ


def test_decoder_layer_from_unsharded_tensors_matches_transformers(stories_dir, stories_hf):
    plan = make_plan(stories_dir, dtype="float32")
    args = ModelArgs.from_config(plan.config)
    x = torch.randn(2, 7, 64)
    with HFReader(stories_dir) as reader:
        layer = DecoderLayer.from_unsharded(args, unsharded_layer(reader, plan, 3), layer_idx=3)
    ours = layer(x)
    hf_layer = stories_hf.model.layers[3]
    pos = torch.arange(7)[None].expand(2, -1)
    cos_sin = stories_hf.model.rotary_emb(x, pos)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref = hf_layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert (ours - ref).abs().max().item() < 1e-5
    names = sorted({n for n, _, _ in layer.named_linears()})
    assert names == [f"transformer.layers.3.{m}" for m in ("attention.dense", "attention.qkv", "mlp.fc", "mlp.gate", "mlp.proj")]


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_inverse_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 10000.0, **scaling}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=params)
    seq = 300
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq)
    ours, factor = INV_FREQ[scaling["rope_type"]](10000.0, 16, scaling, 128, seq)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0) and factor == pytest.approx(ref_factor)


def test_module_quant_algo_honours_exclusions():
    q = {"quant_algo": "FP8", "exclude_modules": ["*lm_head", "*layers.0.*"]}
    assert module_quant_algo("transformer.layers.1.attention.qkv", q) == "FP8"
    assert module_quant_algo("transformer.layers.0.mlp.fc", q) is None
    assert module_quant_algo("lm_head", q) is None
    assert module_quant_algo("transformer.layers.2.mlp.router", {"quant_algo": "FP8", "exclude_modules": None}) is None
    mixed = {"quantized_layers": {"transformer.layers.0.mlp.fc": {"quant_algo": "W8A16"}}}
    assert module_quant_algo("transformer.layers.0.mlp.fc", {"quant_algo": "MIXED_PRECISION"}, mixed) == "W8A16"


def test_unknown_quant_algo_and_quantized_weight_without_handler_fail_clearly():
    w = torch.randint(-8, 8, (4, 4), dtype=torch.int8)
    with pytest.raises(CheckpointError, match="quant_algo 'NOT_AN_ALGO' has no runtime handler"):
        build_linear({"weight": w}, LinearSpec("transformer.layers.0.mlp.fc", "NOT_AN_ALGO"))
    with pytest.raises(CheckpointError, match="'transformer.layers.0.mlp.fc.weight' is torch.int8"):
        build_linear({"weight": w}, LinearSpec("transformer.layers.0.mlp.fc", None))
