"""recipes/gpt-oss-{120b,20b}-mxfp4.yaml on the published configs: read as transformers reads them, validated,
planned (KV bytes with the sliding layers and per-GPU weights with MXFP4 experts split over the EP ranks, checked
against the numbers worked out from the config by hand), and refused for the engine target."""

from __future__ import annotations

import math

import pytest

from trtpipe.models.dims import read_hf_config

from recipe_helpers import RECIPES, run_cli

H, HEADS, KV, D, I, V = 2880, 64, 8, 64, 2880, 201088  # both sizes share these (recipes/configs/README.md)


@pytest.mark.parametrize("name, layers, experts", [("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)])
def test_published_config(name, layers, experts):
    info = read_hf_config(RECIPES / "configs" / name)
    assert (info.architecture, info.num_layers, info.num_experts, info.experts_per_token) == (
        "GptOssForCausalLM",
        layers,
        experts,
        4,
    )
    assert (info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim, info.intermediate_size) == (
        H,
        HEADS,
        KV,
        D,
        I,
    )
    assert info.layer_types == ("sliding_attention", "full_attention") * (layers // 2) and info.sliding_window == 128
    assert info.rope_theta == 150000 and info.rope_scaling["rope_type"] == "yarn" and info.rope_scaling["factor"] == 32
    assert info.raw["quantization_config"]["quant_method"] == "mxfp4"


def _per_gpu_weight_bytes(layers: int, experts: int, tp: int, ep: int) -> int:
    """bf16 everything but the experts (MXFP4: 4 bits + one E8M0 byte per 32 weights = 17/32 byte), router float32."""
    q, kv = HEADS // tp, KV // tp
    attn = (H * (q + 2 * kv) * D + q * D * H) * 2
    expert_w = 3 * H * I * experts // tp * 17 // 32
    router = H * experts * 4 + experts * 4  # weight and bias, float32
    biases = ((q + 2 * kv) * D + H) * 2 + experts // ep * (2 * I // (tp // ep) + H) * 2 + q * 2  # + sinks
    norms = 2 * H * 2
    embed, head = V * H * 2, math.ceil(V / tp) * H * 2 + H * 2
    return layers * (attn + expert_w + router + biases + norms) + embed + head


@pytest.mark.parametrize(
    "name, layers, experts, tp, ep", [("gpt-oss-120b", 36, 128, 4, 4), ("gpt-oss-20b", 24, 32, 1, 1)]
)
def test_validate_and_plan(name, layers, experts, tp, ep):
    recipe = RECIPES / f"{name}-mxfp4.yaml"
    assert run_cli("validate", str(recipe)).exit_code == 0
    out = run_cli("plan", str(recipe))
    assert out.exit_code == 0, out.stderr
    kv = 2 * layers * KV * D * 2  # K and V x layers x KV heads x head_dim x 2 bytes (bf16 KV)
    assert f"KV bytes/token: {kv} for the whole model; per GPU {kv // tp}" in out.stdout
    # a sequence of 16384: the sliding half of the layers holds 128 tokens -> layer average, blocks of 32
    held = math.ceil((layers // 2 * 128 + layers // 2 * 16384) / layers)
    assert f"one sequence of max_seq_len 16384 needs {math.ceil(held / 32)} blocks" in out.stdout
    gib = _per_gpu_weight_bytes(layers, experts, tp, ep) / 2**30
    assert f"weights {gib:.2f} GiB (from config.json)" in out.stdout, out.stdout
    # the experts line sizes them as shipped too (MXFP4, 17/32 byte a weight; it once said bf16, above the total)
    per_layer = 3 * H * I * (experts // ep) * 17 // 32
    assert (
        f"{per_layer / 2**30:.2f} GiB per layer, {layers * per_layer / 2**30:.2f} GiB per GPU of the weights "
        "above" in out.stdout
    ), out.stdout


def test_the_engine_target_is_refused_naming_llmapi(tmp_path):
    recipe = tmp_path / "r.yaml"
    text = (RECIPES / "gpt-oss-20b-mxfp4.yaml").read_text().replace("target: llmapi", "target: engine")
    recipe.write_text(text.replace("source: configs/gpt-oss-20b", f"source: {RECIPES / 'configs' / 'gpt-oss-20b'}"))
    r = run_cli("validate", str(recipe))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and lines[0].endswith("; use target: llmapi"), r.stderr


def test_fp8_quantizes_the_rest_of_an_mxfp4_source_without_a_double_quantization_refusal():
    """The experts stay as shipped (MXFP4), so ``quantization.algo: fp8`` (FP8 attention) quantizes nothing twice;
    a fully pre-quantized source is still refused (tests/quant/imported/test_recipes.py)."""
    r = run_cli(
        "validate",
        str(RECIPES / "gpt-oss-20b-mxfp4.yaml"),
        "--set",
        "quantization.algo=fp8",
        "--set",
        "quantization.kv_cache=fp8",
    )
    assert "already quantized" not in r.output, r.output
    assert "quantization.algo" not in r.output.replace("calibration", ""), r.output
