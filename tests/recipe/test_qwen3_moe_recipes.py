"""recipes/qwen3-30b-a3b-fp8.yaml and recipes/qwen3-235b-a22b-fp8.yaml (llmapi, FP8 + FP8 KV) on the published
config.json files: read, validated and planned, with the KV bytes per token, the expert placement and the per-GPU
weights checked against the arithmetic written out here from the config (not from the planner's code), and the
layouts validate refuses, one line naming the key."""

from __future__ import annotations

import json

import pytest

from trtpipe.models.dims import read_hf_config

from recipe_helpers import RECIPES, run_cli

BIG = RECIPES / "qwen3-235b-a22b-fp8.yaml"
SMALL = RECIPES / "qwen3-30b-a3b-fp8.yaml"


def _hand_weights_per_gpu(cfg: dict, tp: int, ep: int) -> tuple[int, int]:
    """(all weight bytes, expert weight bytes) on one GPU as TensorRT-LLM's PyTorch backend holds the FP8 unified
    checkpoint: attention and experts 1 byte per element (their per-tensor FP8 scales are a few bytes, left out),
    q split by tp, each GPU one copy of ceil(kv / tp) KV heads, ``experts / ep`` whole experts, the router and
    the two RMSNorms per layer in bfloat16, embedding and lm_head each one vocab slice of ``vocab / tp`` rows."""
    h, d, layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] // tp, -(-cfg["num_key_value_heads"] // tp)
    attention = h * q * d + 2 * h * kv * d + q * d * h
    experts = cfg["num_experts"] // ep * 3 * h * cfg["moe_intermediate_size"]
    router, norms = cfg["num_experts"] * h * 2, 2 * h * 2
    vocab_slice = cfg["vocab_size"] // tp * h * 2
    return layers * (attention + experts + router + norms) + 2 * vocab_slice + h * 2, layers * experts


@pytest.mark.parametrize("recipe, tp, ep", [(BIG, 8, 8), (SMALL, 1, 1)], ids=["235b-a22b", "30b-a3b"])
def test_validate_and_plan_against_the_hand_arithmetic(recipe, tp, ep):
    assert run_cli("validate", str(recipe)).exit_code == 0
    cfg = json.loads((RECIPES / "configs" / recipe.stem.removesuffix("-fp8") / "config.json").read_text())
    result = run_cli("plan", str(recipe), "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["tp"], plan["experts"]["moe_ep"], plan["experts"]["moe_tp"]) == (tp, ep, tp // ep)
    # K and V x layers x KV heads x head_dim x 1 byte (FP8); at tp 8 the 4 KV heads are one per GPU (replicated)
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    per_gpu_kv = 2 * cfg["num_hidden_layers"] * -(-cfg["num_key_value_heads"] // tp) * cfg["head_dim"]
    assert (plan["kv_bytes_per_token_model"], plan["kv_bytes_per_token_per_gpu"]) == (kv, [per_gpu_kv])
    weights, experts = _hand_weights_per_gpu(cfg, tp, ep)
    assert plan["experts"]["experts_per_gpu"] == 128 // ep
    assert plan["experts"]["expert_bytes_per_gpu"] == experts
    assert plan["weight_bytes_per_gpu"] == weights
    assert plan["fits"]


def test_235b_numbers_as_plan_prints_them():
    out = run_cli("plan", str(BIG))
    assert out.exit_code == 0, out.stderr
    assert "KV bytes/token: 96256 for the whole model; per GPU 24064 (pp rank 0, 94 layers)" in out.stdout
    assert "experts: 16 of 128 per GPU (moe_ep 8 x moe_tp 1; 1536 of each expert's rows)" in out.stdout
    assert "26.44 GiB per GPU of the weights above" in out.stdout  # 94 x 16 x 3 x 4096 x 1536 B
    assert "pp rank 0: weights 27.65 GiB (from config.json)" in out.stdout  # 29685424128 B


def test_published_configs_read_as_qwen3_moe():
    for name, layers, hidden, heads, width in (
        ("qwen3-235b-a22b", 94, 4096, 64, 1536),
        ("qwen3-30b-a3b", 48, 2048, 32, 768),
    ):
        info = read_hf_config(RECIPES / "configs" / name)
        assert (
            info.architecture,
            info.num_layers,
            info.hidden_size,
            info.num_heads,
            info.num_kv_heads,
            info.head_dim,
        ) == ("Qwen3MoeForCausalLM", layers, hidden, heads, 4, 128)
        assert (info.num_experts, info.experts_per_token, info.expert_intermediate_size) == (128, 8, width)
        assert info.raw["norm_topk_prob"] is True and info.raw["mlp_only_layers"] == []


@pytest.mark.parametrize(
    "overrides, key, text",
    [
        (("parallel.moe_ep=3",), "parallel.moe_ep", "moe_ep (3) x moe_tp (1) must equal tp (8)"),
        (
            ("parallel.tp=6", "parallel.moe_ep=6"),
            "parallel.moe_ep",
            "the model's 128 experts do not divide by moe_ep=6",
        ),
        (("parallel.tp=6", "parallel.moe_ep=6"), "parallel.tp", "tp=6 is not a multiple of the model's 4 KV heads"),
    ],
    ids=["ep-times-tp", "experts", "kv-heads"],
)
def test_validate_refuses_layouts_naming_the_key(overrides, key, text):
    result = run_cli("validate", str(BIG), *[a for o in overrides for a in ("--set", o)])
    assert result.exit_code == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert any(f"{key}:" in ln and text in ln for ln in lines), result.stderr


def test_moe_int4_experts_are_w4a8_awq_on_llmapi_only_in_the_shapes_tensorrt_llm_loads():
    for algo, gpu in (("nvfp4", "b200-180gb"), ("w4a8_awq", "h100-sxm-80gb")):  # FP4 GEMMs need Blackwell
        assert (
            run_cli(
                "validate", str(SMALL), "--set", f"quantization.algo={algo}", "--set", f"engine.gpu={gpu}"
            ).exit_code
            == 0
        ), algo
    # TensorRT-LLM's fused MoE loads int4 per-group experts only as W4A8 (WInt4AFP8FusedMoEMethod)
    for algo in ("int4_awq", "int4_wo"):
        result = run_cli("validate", str(SMALL), "--set", f"quantization.algo={algo}")
        assert result.exit_code == 2
        assert (
            f"quantization.algo: {algo} is refused for mixture-of-experts models on target llmapi: TensorRT-LLM's "
            "fused MoE loads int4 per-group experts only as W4A8" in result.stderr
        ), result.stderr
        assert "use w4a8_awq, or fp8 or nvfp4" in result.stderr, result.stderr
    result = run_cli("validate", str(SMALL), "--set", "quantization.algo=w4a8_awq", "--set", "target=engine")
    assert result.exit_code == 2
    assert (
        "quantization.algo: w4a8_awq for mixture-of-experts models is written only for target: llmapi "
        "(TensorRT-LLM 1.2's MoE layer takes W4A8 experts' group scales interleaved with a per-expert alpha"
        in result.stderr
    ), result.stderr
    result = run_cli(
        "validate", str(SMALL), "--set", "quantization.algo=w4a8_awq", "--set", "quantization.group_size=64"
    )
    assert result.exit_code == 2
    assert (
        "quantization.group_size: w4a8_awq mixture-of-experts experts are loaded by TensorRT-LLM in groups of "
        "128 only (got 64)" in result.stderr
    ), result.stderr
    # K of the down GEMM is one expert's width per moe_tp rank: 768 / 8 = 96 is no multiple of 128
    result = run_cli("validate", str(SMALL), "--set", "quantization.algo=w4a8_awq", "--set", "parallel.tp=8")
    assert result.exit_code == 2
    assert (
        "parallel.moe_tp: w4a8_awq: the expert width 768 is 96 per moe_tp rank (moe_tp=8), not a multiple of 128"
        in result.stderr
    ), result.stderr
    assert (
        run_cli(
            "validate",
            str(SMALL),
            "--set",
            "quantization.algo=w4a8_awq",
            "--set",
            "parallel.tp=8",
            "--set",
            "parallel.moe_ep=8",
            "--set",
            "parallel.moe_tp=1",
        ).exit_code
        == 0
    )
