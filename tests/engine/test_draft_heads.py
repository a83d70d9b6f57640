"""An EAGLE-3 head's bytes from its config.json (trtpipe/engine/draft_heads.py), and ``trtpipe plan`` of
recipes/llama-3.3-70b-fp8-eagle3.yaml: Llama-3.3-70B FP8 on two H100s with the head's memory counted.

The head config is SpecForge's Llama-3 70B EAGLE-3 architecture (sgl-project/SpecForge
``configs/llama3-70B-ealge3.json@82b62f6e``): hidden 8192, 64 heads / 8 KV heads of 128, intermediate 28672, one
layer, vocab 128256, draft vocab 32000, float16. By hand:
- fc: 3 x 8192 x 8192 = 201,326,592
- attention: q/k/v read 2 x 8192: 16384 x (64 + 8 + 8) x 128 = 167,772,160, o_proj 8192 x 8192 = 67,108,864
- MLP: 3 x 8192 x 28672 = 704,643,072
- norms: 4 x 8192 = 32,768 (input, hidden, post-attention, final)
- lm_head: 32000 x 8192 = 262,144,000
- sum 1,403,027,456 parameters x 2 bytes = 2,806,054,912, + d2t 32000 x 8 = 256,000 -> 2,806,310,912 bytes
- per GPU at tp 2: 1,403,155,456 bytes; draft KV per token per GPU: 2 x 1 layer x 4 KV heads x 128 x 1 byte (FP8)
  = 1024.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.engine.draft_heads import eagle3_head_bytes, eagle3_head_params
from trtpipe.jsonfile import load_json

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RECIPE = RECIPES / "llama-3.3-70b-fp8-eagle3.yaml"
HEAD = RECIPES / "configs" / "eagle3-llama-3.3-70b" / "config.json"
HEAD_BYTES = 2_806_310_912


def test_the_head_bytes_equal_the_hand_count():
    cfg = load_json(HEAD)
    assert eagle3_head_params(cfg) == {
        "fc": 201_326_592,
        "midlayer.self_attn": 167_772_160 + 67_108_864,
        "midlayer.mlp": 704_643_072,
        "norms": 32_768,
        "lm_head": 262_144_000,
    }
    assert eagle3_head_bytes(cfg) == HEAD_BYTES
    own_embedding = {**cfg, "target_hidden_size": 4096}  # a head narrower than its target: fc reads 3 x 4096
    parts = eagle3_head_params(own_embedding)
    assert (parts["fc"], parts["embed_tokens"]) == (3 * 4096 * 8192, 128256 * 8192)


def test_plan_counts_the_head_on_each_gpu():
    from trtpipe.app.planning import resolve

    with_head = resolve(RECIPE).plan
    d = with_head.draft
    assert (d.weight_bytes, d.kv_bytes_per_token, d.extra_positions) == (HEAD_BYTES // 2, 1024.0, 3)
    assert d.counted_from == "EAGLE-3 head computed from its config.json"
    plain = resolve(RECIPE, ["speculative.decoding_type=none", "speculative.speculative_model=null"]).plan
    assert with_head.ranks[0].weight_bytes - plain.ranks[0].weight_bytes == HEAD_BYTES // 2
    assert with_head.ranks[0].kv_bytes_per_token - plain.ranks[0].kv_bytes_per_token == 1024
    assert with_head.fits


def test_the_recipe_validates_and_plan_shows_the_draft_memory():
    runner = CliRunner()
    res = runner.invoke(main, ["validate", str(RECIPE)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["plan", str(RECIPE)])
    assert res.exit_code == 0, res.output
    assert (
        "speculative Eagle3: draft weights 1.31 GiB per GPU (EAGLE-3 head computed from its config.json, included "
        "above), draft KV 1024 bytes/token per GPU (included above), sequences +3 positions"
    ) in res.output
