"""Building blocks: a decoder layer from unsharded tensors (what calibration uses), rope tables, the linear registry."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from numerics import U32, assert_as_accurate, error_scale
from trtpipe.checkpoint.convert import make_plan, unsharded_layer
from trtpipe.checkpoint.hf import HFReader
from trtpipe.errors import CheckpointError
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

    def run(layer, dtype):
        with torch.no_grad():
            out = layer(
                x.to(dtype),
                attention_mask=mask.to(dtype),
                position_ids=pos,
                position_embeddings=tuple(t.to(dtype) for t in cos_sin),
            )
        return out[0] if isinstance(out, tuple) else out

    ref32, ref64 = run(hf_layer, torch.float32), run(copy.deepcopy(hf_layer).double(), torch.float64)
    # ours may be off the float64 layer by what transformers' own float32 run is (x the order factor)
    assert_as_accurate(ours, ref64, error_scale(ref32, ref64), "decoder layer 3")
    names = sorted({n for n, _, _ in layer.named_linears()})
    assert names == [
        f"transformer.layers.3.{m}" for m in ("attention.dense", "attention.qkv", "mlp.fc", "mlp.gate", "mlp.proj")
    ]


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_inverse_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 10000.0, **scaling}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, rope_parameters=params)
    seq = 300
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu", seq)
    ours, factor = INV_FREQ[scaling["rope_type"]](10000.0, 16, scaling, 128, seq)
    # Both are float32 evaluations of base^(-i/d) (/ factor, smoothing): rounding the exponent i/d costs
    # |i/d ln base| u <= u ln(base) relative, pow/divide/the interpolation a few more roundings (<= 4 u).
    rtol = 2 * (math.log(10000.0) + 4) * U32  # two such evaluations, each within it of the exact value
    torch.testing.assert_close(ours, ref.float(), rtol=rtol, atol=0)
    assert factor == pytest.approx(ref_factor, rel=4 * U32)  # 1 + 0.1 ln(s): a log and two roundings


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
