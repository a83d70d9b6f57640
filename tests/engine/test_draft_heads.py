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


def test_an_eagle1_engine_head_is_counted_once_per_eaglenet():
    """yuhuili/EAGLE-Vicuna-7B-v1.3's shapes (as recalled, Llama-7B: hidden 4096, 32 heads of 128, intermediate
    11008, one layer, vocab 32000, float16) with upstream's default num_eagle_layers 4. By hand, per EagleNet:
    fc 2 x 4096 x 4096 + 4096 = 33,558,528; the layer's q/k/v/o 4 x 4096 x 4096 = 67,108,864, MLP 3 x 4096 x 11008 =
    135,266,304, post_layernorm 4096; embedding and lm_head 32000 x 4096 = 131,072,000 each: 498,081,792 parameters;
    x 4 EagleNets x 2 bytes = 3,984,654,336 bytes."""
    from trtpipe.engine.draft_heads import eagle1_engine_bytes, eagle1_engine_params

    cfg = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "num_hidden_layers": 1,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    }
    parts = eagle1_engine_params(cfg, 1)
    assert parts == {
        "fc": 33_558_528,
        "layers": 67_108_864 + 135_266_304 + 4096,
        "vocab_embedding": 131_072_000,
        "lm_head": 131_072_000,
    }
    assert sum(parts.values()) == 498_081_792
    assert eagle1_engine_bytes(cfg, 4) == 3_984_654_336
    two = eagle1_engine_params({**cfg, "num_hidden_layers": 2}, 1)  # a later layer has its input_layernorm
    assert two["layers"] == 2 * parts["layers"] + 4096


def test_plan_counts_an_eagle1_head_and_its_kv(tmp_path, stories_dir):
    import json

    from trtpipe.app.planning import resolve
    from trtpipe.engine.draft_heads import eagle1_engine_bytes
    from trtpipe.models.synthetic_heads import make_eagle1_head

    head = make_eagle1_head(stories_dir, tmp_path / "head", seed=1)
    cfg = json.loads((head / "config.json").read_text())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: eagle\ntarget: engine\nmodel:\n  source: {stories_dir}\nengine:\n  gpu: h100-sxm-80gb\n"
        "  max_batch_size: 64\n  max_input_len: 128\n  max_seq_len: 256\n  max_num_tokens: 4096\n"
        f"speculative:\n  decoding_type: eagle\n  speculative_model: {head}\n  max_draft_len: 3\n"
    )
    d = resolve(recipe).plan.draft
    # 3 EagleNets (the chain's depth) of the float32 head; KV: 2 x 1 layer x the target's KV heads x head size x 2
    assert d.weight_bytes == eagle1_engine_bytes(cfg, 3) and d.counted_from.startswith("EAGLE head x 3 EagleNets")
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    plain = resolve(recipe, ["speculative.decoding_type=none", "speculative.speculative_model=null"]).plan
    target = json.loads((stories_dir / "config.json").read_text())
    element = plain.ranks[0].kv_bytes_per_token / (2 * target["num_hidden_layers"] * kv_heads * head_dim)
    assert element == 2  # model.dtype auto: a float32 source becomes float16
    assert d.kv_bytes_per_token == 2 * 1 * kv_heads * head_dim * element
    assert d.extra_positions == 3
