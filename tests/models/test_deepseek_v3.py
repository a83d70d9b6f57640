"""DeepSeek-V3 / Kimi-K2 (``DeepseekV3ForCausalLM``): multi-head latent attention with its compressed KV, leading dense
layers, shared experts, sigmoid group-limited routing with the score-correction bias, YaRN's attention scale.

Oracle: transformers 5.25's DeepseekV3 in float64 (experts on the eager path); the tolerance is ORDER_FACTOR x
transformers' own float32 error on the same input (tests/numerics.py). Shapes: the shrunk configs of
trtpipe.models.synthetic ("deepseek_v3", "kimi_k2") keep the released models' ratios."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner

from numerics import assert_as_accurate, assert_greedy_equal, error_scale, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.cli import main
from trtpipe.errors import CheckpointError
from trtpipe.models import num_params
from trtpipe.models.dims import parse_hf_config, read_hf_config
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.generate import generate
from trtpipe.runtime.mla import yarn_mscale


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF dir, root, transformers float32, its float64 copy)."""
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for kind, extra in (("deepseek_v3", {}), ("kimi_k2", {}), ("v2_lite_q", {"q_lora_rank": None})):
        d = make_synthetic("deepseek_v3" if kind == "v2_lite_q" else kind, root / kind, seed=3, **extra)
        hf = load_hf(d)
        out[kind] = (d, root, hf, hf_float64(hf))
    return out


IDS = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize(
    "kind,tp,pp,ep",
    [("deepseek_v3", 1, 1, 1), ("deepseek_v3", 2, 1, 1), ("deepseek_v3", 2, 1, 2), ("kimi_k2", 1, 1, 1)]
    + [("kimi_k2", 2, 1, 2), ("kimi_k2", 1, 2, 1), ("v2_lite_q", 2, 1, 1)],
)
def test_logits_as_accurate_as_transformers(models, kind, tp, pp, ep, tmp_path):
    """tp splits the heads of q_b / kv_b / dense, the shared experts and (moe_tp) the experts; ep the experts; pp 2
    puts the dense layer and the first MoE layer on one stage, the last MoE layer on the other."""
    d, _, hf32, hf64 = models[kind]
    model = load_checkpoint(convert(d, tmp_path / "ckpt", tp=tp, pp=pp, moe_ep=ep, dtype="float32"))
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf64(IDS).logits
    assert_as_accurate(model(IDS), ref64, error_scale(ref32, ref64), f"{kind} tp{tp} pp{pp} ep{ep}")


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k2", "v2_lite_q"])
def test_hf_checkpoint_runtime_as_accurate_as_transformers(models, kind):
    """The runtime on the HF checkpoint as stored (what the llmapi target exports and the OpenAI twin serves)."""
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    d, _, hf32, hf64 = models[kind]
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf64(IDS).logits
    assert_as_accurate(load_hf_checkpoint(d)(IDS), ref64, error_scale(ref32, ref64), f"{kind} HF checkpoint")


def test_each_deepseek_piece_changes_the_logits(models, tmp_path):
    """The oracle test is not vacuous: without the score-correction bias, the YaRN mscale, the shared experts or the
    routed scaling factor, the logits move far outside the tolerance."""
    import trtpipe.runtime.mla as mla

    d, _, hf32, hf64 = models["deepseek_v3"]
    model = load_checkpoint(convert(d, tmp_path / "ckpt", dtype="float32"))
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf64(IDS).logits
    bound = 4 * error_scale(ref32, ref64)

    def err():
        return float((model(IDS).double() - ref64).abs().max())

    assert err() <= bound
    layer = model.layers[1]
    bias = layer.score_bias
    layer.score_bias = torch.zeros_like(bias)
    assert err() > 100 * bound, "the score-correction bias"
    layer.score_bias = bias
    shared = layer.shared
    layer.shared = None
    assert err() > 100 * bound, "the shared experts"
    layer.shared = shared
    scale = layer.attention[0].scale
    layer.attention[0].scale = scale / mla.yarn_mscale(model.args.rotary_scaling)
    assert err() > 100 * bound, "YaRN's mscale"
    layer.attention[0].scale = scale
    assert err() <= bound


def test_cached_and_batched_decoding_greedy_as_transformers(models, tmp_path):
    """The KV cache holds the latent and the rope key only; per-sequence and batched decoding (BatchKVCache) give
    transformers' greedy tokens (up to a genuine near-tie)."""
    d, _, hf32, hf64 = models["deepseek_v3"]
    model = load_checkpoint(convert(d, tmp_path / "ckpt", tp=2, dtype="float32"))
    prompts = [[5, 17, 33, 101, 7], [9, 8, 200, 45, 66, 12, 90, 3]]
    for batched in (False, True):
        ours = generate(model, prompts, 8, batched=batched)
        for p, got in zip(prompts, ours):
            with torch.no_grad():
                ref = hf32.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            assert_greedy_equal(got, ref, hf32, hf64, p, f"deepseek_v3 batched={batched}")
    from trtpipe.runtime.model import KVCache

    cache = KVCache()
    model(torch.tensor([prompts[0]]), cache, 0)
    latent, value = cache.store[(0, 0)]
    assert latent.shape == (1, 1, 5, 32 + 4) and value.shape == (1, 1, 5, 0)


def test_paged_steps_cache_latents_and_match_transformers(models):
    """The serving executor's paged pool holds kv_lora_rank + qk_rope_head_dim values per token per layer and rank,
    nothing for values; contexts then their generation tokens batched: logits against transformers float64 at tp2 ep2."""
    from trtpipe.serving.api import StepBatch, StepEntry
    from trtpipe.serving.reference_engine import ReferenceEngine

    d, root, hf32, hf64 = models["kimi_k2"]
    model = load_checkpoint(convert(d, root / "paged_tp2ep2", tp=2, moe_ep=2, dtype="float32"))
    engine = ReferenceEngine(model)
    engine.allocate(num_blocks=16, tokens_per_block=8)
    k, v = engine.pools[(1, 1)]
    assert k.shape == (128, 1, 36) and v.shape == (128, 1, 0)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 14, 20)]
    tables = [[4 * i + b for b in range(4)] for i in range(3)]
    got_ctx = engine.logits(StepBatch(0, [StepEntry(i, p, 0, tables[i], True, True) for i, p in enumerate(prompts)]))
    with torch.no_grad():
        ref_ctx = torch.stack([hf64(torch.tensor([p])).logits[0, -1] for p in prompts])
    nxt = [int(t) for t in ref_ctx.argmax(-1)]
    got_gen = engine.logits(
        StepBatch(1, [StepEntry(i, [nxt[i]], len(p), tables[i], False, True) for i, p in enumerate(prompts)])
    )
    seqs = prompts + [p + [t] for p, t in zip(prompts, nxt)]
    with torch.no_grad():
        ref = torch.stack([hf64(torch.tensor([s])).logits[0, -1] for s in seqs])
        own = torch.stack([hf32(torch.tensor([s])).logits[0, -1] for s in seqs])
    assert_as_accurate(torch.cat([got_ctx, got_gen]), ref, error_scale(own, ref), "kimi_k2 paged steps tp2 ep2")


def test_config_facts_parameter_count_and_kv_values(models):
    d, _, hf, _ = models["deepseek_v3"]
    info = read_hf_config(d)
    a = info.mla
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_head_dim, a.kv_values_per_token) == (24, 32, 12, 36)
    assert (info.head_dim, info.rotary_dim, info.dense_layers, info.shared_experts) == (12, 4, 1, 1)
    assert (info.moe_scoring, info.moe_groups, info.moe_topk_groups, info.routed_scaling_factor) == (
        "sigmoid",
        4,
        2,
        2.5,
    )
    assert [info.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert num_params(info) == sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")
    )
    lite = models["v2_lite_q"]
    assert read_hf_config(lite[0]).mla.q_lora_rank == 0
    assert num_params(read_hf_config(lite[0])) == sum(p.numel() for p in lite[2].parameters()) + 2 * 16
    # DeepSeek-V3's own sizes (transformers' DeepseekV3Config defaults): 512 + 64 values cached per token per layer
    v3 = parse_hf_config({**_v3_defaults(), "architectures": ["DeepseekV3ForCausalLM"]})
    assert v3.mla.kv_values_per_token == 576 and v3.head_dim == 192 and v3.rotary_dim == 64
    # YaRN factor 40, mscale_all_dim 1: (0.1 ln 40 + 1)^2 = 1.87385..., as transformers' yarn_get_mscale squared
    from transformers.modeling_rope_utils import yarn_get_mscale

    assert yarn_mscale({"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}) == yarn_get_mscale(40, 1.0) ** 2
    assert yarn_mscale({"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}) == pytest.approx(1.873854, abs=1e-6)


def _v3_defaults() -> dict:
    from transformers import DeepseekV3Config

    return DeepseekV3Config().to_dict()


def test_mtp_layers_are_skipped_by_the_conversion(models, tmp_path):
    """A checkpoint's multi-token-prediction layer (model.layers.{num_hidden_layers}.*) is not a decoder layer: the
    conversion leaves it (the llmapi export keeps the source's tensors); any other extra tensor is still an error."""
    from safetensors.torch import load_file, save_file

    src, _, _, _ = models["deepseek_v3"]
    d = tmp_path / "mtp"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert load_checkpoint(convert(d, tmp_path / "ckpt", dtype="float32")).args.num_layers == 3
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.3\.eh_proj\.weight' is not part of"):
        convert(d, tmp_path / "ckpt2", dtype="float32")


def _validate(tmp_path, hf_dir, body: str):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\n{body}model:\n  source: {hf_dir}\n")
    return CliRunner().invoke(main, ["validate", str(recipe)])


def test_validate_refuses_the_engine_target_and_names_llmapi(models, tmp_path):
    d = models["deepseek_v3"][0]
    r = _validate(tmp_path, d, "target: engine\n")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert re.search(
        r"target: engine: TensorRT-LLM 1\.2 has no TensorRT engine for DeepseekV3ForCausalLM .*; use target: llmapi$",
        lines[0],
    ), r.output
    assert _validate(tmp_path, d, "target: llmapi\n").exit_code == 0, _validate(tmp_path, d, "target: llmapi\n").output


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, r"config.json: n_group 3 does not divide n_routed_experts 16"),
        ({"scoring_func": "softmax"}, r"config.json: scoring_func 'softmax' is not supported; allowed: sigmoid"),
    ],
)
def test_validate_refuses_what_the_family_cannot_honour(change, message, models, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    cfg = json.loads((models["deepseek_v3"][0] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    r = _validate(tmp_path, d, "target: llmapi\n")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and re.search(rf"model\.source: {message}", lines[0]), r.output


@pytest.mark.parametrize(
    "body, message",
    [
        ("quantization:\n  algo: fp8\n", r"quantization\.algo: fp8 is not supported for DeepseekV3ForCausalLM: .*"),
        ("quantization:\n  kv_cache: fp8\n", r"quantization\.kv_cache: fp8 is not supported for DeepseekV3ForCausalLM"),
    ],
)
def test_validate_refuses_recipe_quantization(body, message, models, tmp_path):
    """Calibration, the quantizers and the FP8 KV cache know q/k/v attention, not MLA: refused before any work."""
    r = _validate(tmp_path, models["deepseek_v3"][0], "target: llmapi\n" + body)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and re.search(message, lines[0]), r.output


def test_runtime_refuses_a_quantized_latent_cache(models, tmp_path):
    ckpt = convert(models["deepseek_v3"][0], tmp_path / "ckpt", dtype="float32")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization"]["kv_cache_quant_algo"] = "FP8"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="kv_cache_quant_algo FP8 is not supported for multi-head latent"):
        load_checkpoint(ckpt)
