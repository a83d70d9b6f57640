"""recipes/gemma-3-27b-fp8.yaml on the published gemma-3-27b-it config: read through its text_config with
transformers' Gemma3TextConfig defaults, validated and planned (KV bytes and blocks checked against the numbers
worked out from the config by hand), the per-layer attention window the Triton repository passes, and what
validate refuses, one line naming the key."""

from __future__ import annotations

import json
import math
import shutil

import pytest

pytest.importorskip("tritonclient", reason="pip install 'trtpipe[serve]'")  # before the imports that need it

from trtpipe.models.dims import read_hf_config
from trtpipe.triton.repo import EngineInfo

from recipe_helpers import RECIPES, run_cli

RECIPE = RECIPES / "gemma-3-27b-fp8.yaml"
CONFIG = RECIPES / "configs" / "gemma-3-27b-it"


def test_published_config_reads_through_text_config_with_the_defaults():
    info = read_hf_config(CONFIG)
    assert (info.architecture, info.model_type, info.weight_prefix) == (
        "Gemma3ForConditionalGeneration",
        "gemma3_text",
        "language_model.",
    )
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim) == (
        62,
        5376,
        32,
        16,
        128,
    )
    assert info.raw["query_pre_attn_scalar"] == 168 and info.sliding_window == 1024
    # omitted by the published text_config: Gemma3TextConfig's defaults
    assert (info.vocab_size, info.max_position_embeddings, info.rms_norm_eps, info.tie_word_embeddings) == (
        262208,
        131072,
        1e-6,
        True,
    )
    assert (info.rope_theta, info.rope_local_theta, info.hidden_act) == (1e6, 1e4, "gelu_pytorch_tanh")
    assert info.rope_scaling == {"factor": 8.0, "rope_type": "linear"}  # global layers only
    assert [i for i, t in enumerate(info.layer_types) if t == "full_attention"] == list(range(5, 62, 6))


def test_validate_and_plan_the_recipe():
    assert run_cli("validate", str(RECIPE)).exit_code == 0
    out = run_cli("plan", str(RECIPE))
    assert out.exit_code == 0, out.stderr
    kv_per_token = 2 * 62 * 16 * 128 * 1  # K and V x layers x KV heads x head_dim x 1 byte (FP8 KV)
    assert f"KV bytes/token: {kv_per_token} for the whole model; per GPU {kv_per_token // 2}" in out.stdout
    # a sequence of 8192: 52 sliding layers hold 1024 tokens, 10 global ones all 8192 -> layer average, blocks of 32
    held = math.ceil((52 * 1024 + 10 * 8192) / 62)
    assert f"one sequence of max_seq_len 8192 needs {math.ceil(held / 32)} blocks" in out.stdout
    assert math.ceil(held / 32) == 69


def test_the_triton_repository_passes_one_window_per_layer(tmp_path):
    types = tuple(read_hf_config(CONFIG).layer_types)
    e = EngineInfo(tmp_path, False, 2, 64, 1, 4096, 8192, sliding_window=1024, layer_types=types)
    windows = [int(w) for w in str(e.attention_window).split(",")]
    assert windows == [8192 if t == "full_attention" else 1024 for t in types] and len(windows) == 62
    mistral = EngineInfo(tmp_path, False, 2, 64, 1, 4096, 8192, sliding_window=4096)
    assert mistral.attention_window == 4096  # one window for every layer, unchanged


def _recipe_with(tmp_path, **text):
    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg["text_config"].update(text)
    src = tmp_path / "model"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "gemma-3-27b-fp8.yaml"
    recipe.write_text(RECIPE.read_text().replace("source: configs/gemma-3-27b-it", f"source: {src}"))
    shutil.copytree(RECIPES / "data", tmp_path / "data")
    return recipe


def test_validate_refuses_what_gemma3_cannot_honour_naming_the_key(tmp_path):
    for key, value in (("use_bidirectional_attention", True), ("attn_logit_softcapping", 50.0)):
        recipe = _recipe_with(tmp_path / key, **{key: value})
        result = run_cli("validate", str(recipe))
        assert result.exit_code != 0
        lines = [ln for ln in result.stderr.splitlines() if key in ln]
        assert len(lines) == 1 and "config.json" in lines[0], result.stderr
