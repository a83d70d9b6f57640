"""``trtpipe plan`` of the published DeepSeek-R1-0528 and Kimi-K2-Instruct configs (recipes/) on 8 x H200, with the
numbers worked out by hand here: the MLA cache holds kv_lora_rank + qk_rope_head_dim = 512 + 64 values per token per
layer on every GPU (not split by heads); block-FP8 weights take one byte each; the first dense layers hold no
experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _plan(name: str) -> dict:
    r = CliRunner().invoke(main, ["plan", str(RECIPES / name), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _by_hand(heads: int, experts: int, dense: int, vocab: int, tp: int = 8, layers: int = 61) -> int:
    """One GPU's weight bytes: FP8 projections (1 byte), bf16 norms / embedding / lm_head, float32 router + bias."""
    h, qa, kvl, rope, nope, v = 7168, 1536, 512, 64, 128, 128
    attn = h * qa + h * (kvl + rope) + qa * heads * (nope + rope) // tp + kvl * heads * (nope + v) // tp
    attn += heads * v * h // tp
    norms = (qa + kvl + 2 * h) * 2
    dense_mlp = 3 * h * 18432 // tp
    moe = 3 * h * 2048 * experts // tp + 3 * h * 2048 // tp + experts * (h + 1) * 4
    embedding, head = vocab * h * 2, (vocab // tp) * h * 2 + h * 2
    return layers * (attn + norms) + dense * dense_mlp + (layers - dense) * moe + embedding + head


@pytest.mark.parametrize(
    "recipe,heads,experts,dense,vocab",
    [("deepseek-r1-0528-fp8.yaml", 128, 256, 3, 129280), ("kimi-k2-instruct-fp8.yaml", 64, 384, 1, 163840)],
)
def test_plan_on_eight_h200(recipe, heads, experts, dense, vocab):
    p = _plan(recipe)
    assert (p["gpu"], p["tp"], p["fits"]) == ("h200-141gb", 8, True)
    assert p["kv_bytes_per_token_model"] == 61 * 576 * 2 == 70272  # bf16 cache, 61 layers x (512 + 64) values
    assert p["kv_bytes_per_token_per_gpu"] == [70272]  # the latent is not split across the 8 GPUs
    assert p["weight_bytes_per_gpu"] == _by_hand(heads, experts, dense, vocab)
    e = p["experts"]
    assert e["experts_per_gpu"] == experts // 8
    assert e["expert_bytes_per_gpu"] == (61 - dense) * (experts // 8) * 3 * 7168 * 2048
    assert p["kv_tokens"] == p["kv_pool_bytes"][0] // 70272


def test_predict_serves_the_shipped_block_fp8_as_fp8():
    """algo: none on DeepSeek's block-FP8 source is FP8 weights and GEMMs for the cost model, not bf16."""
    from trtpipe.app import predictor as P

    fp8 = P.recipe_setup(RECIPES / "deepseek-r1-0528-fp8.yaml", [])
    assert fp8.deployment.precision == "fp8" and " fp8 (PyTorch backend)" in fp8.label
