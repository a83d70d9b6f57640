"""Attention data parallel in the checkpoint and the one-process runtime: every rank file holds the whole attention,
dense MLP, shared experts, embedding and lm_head and its block of routed experts (``mapping.enable_attention_dp``);
the one-process model of such a checkpoint computes what transformers' float64 DeepseekV3 does. (One process per
rank: tests/serving/mpi/test_attention_dp_ranks.py.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from numerics import assert_as_accurate, error_scale, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import load_checkpoint

IDS = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(4))
EXPERTS = ("mlp.fc.", "mlp.proj.")  # the routed experts' tensors (TRT-LLM names)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_synthetic("deepseek_v3", tmp_path_factory.mktemp("adp") / "hf", seed=3)


def test_rank_files_hold_whole_attention_and_their_experts(hf_dir, tmp_path):
    whole = load_file(convert(hf_dir, tmp_path / "tp1", dtype="float32") / "rank0.safetensors")
    ckpt = convert(hf_dir, tmp_path / "adp", tp=2, moe_ep=2, dtype="float32", attention_dp=True)
    assert json.loads((ckpt / "config.json").read_text())["mapping"]["enable_attention_dp"] is True
    ranks = [load_file(ckpt / f"rank{r}.safetensors") for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(whole)
    experts = [k for k in whole if any(f".{e}" in k for e in EXPERTS)]
    assert experts and len(experts) < len(whole)
    for name, t in whole.items():
        if name in experts:  # [E, ...]: rank r holds experts r*E/2 ..
            half = t.shape[0] // 2
            for r in range(2):
                assert torch.equal(ranks[r][name], t[r * half : (r + 1) * half]), name
        else:
            assert torch.equal(ranks[0][name], t) and torch.equal(ranks[1][name], t), name


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k2", "qwen3_moe", "gpt_oss", "mixtral"])
def test_one_process_attention_dp_logits_as_transformers(kind, tmp_path):
    d = make_synthetic(kind, tmp_path / kind, seed=3 if kind in ("deepseek_v3", "kimi_k2") else 1)
    model = load_checkpoint(convert(d, tmp_path / "ckpt", tp=2, moe_ep=2, dtype="float32", attention_dp=True))
    hf32 = load_hf(d)
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf_float64(hf32)(IDS).logits
    assert_as_accurate(model(IDS), ref64, error_scale(ref32, ref64), f"{kind} attention-DP 2 ep 2")


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(tp=1), "attention data parallel needs a mixture-of-experts model at tp > 1"),
        (dict(tp=2, use_parallel_embedding=True), "keeps the whole embedding on every rank"),
    ],
)
def test_conversion_refuses_what_attention_dp_cannot_be(hf_dir, tmp_path, kw, message):
    with pytest.raises(CheckpointError, match=message):
        convert(hf_dir, tmp_path / "ckpt", dtype="float32", attention_dp=True, **kw)
    assert not (tmp_path / "ckpt").exists()


def test_conversion_refuses_attention_dp_of_a_dense_model(stories_dir, tmp_path):
    with pytest.raises(CheckpointError, match="needs a mixture-of-experts model at tp > 1.*got 0 experts at tp=2"):
        convert(stories_dir, tmp_path / "ckpt", tp=2, dtype="float32", attention_dp=True)


# --- the recipe key: parallel.attention_dp ---------------------------------------------------------------------


def _validate(tmp_path, hf_dir, body: str):
    from click.testing import CliRunner

    from trtpipe.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: t\n{body}model:\n  source: {hf_dir}\n")
    return CliRunner().invoke(main, ["validate", str(recipe)])


ADP = "parallel:\n  tp: 2\n  moe_ep: 2\n  attention_dp: true\n"


def test_attention_dp_recipe_writes_enable_attention_dp(hf_dir, tmp_path):
    from trtpipe.app.validation import load_recipe
    from trtpipe.export.serving import llm_api_options, options_yaml

    r = _validate(tmp_path, hf_dir, "target: llmapi\n" + ADP)
    assert r.exit_code == 0, r.output
    recipe = load_recipe(tmp_path / "r.yaml", ())
    for version in ("1.0", "1.1", "1.2"):
        opts = llm_api_options(recipe, version)
        assert opts["enable_attention_dp"] is True and opts["tensor_parallel_size"] == 2
        assert "enable_attention_dp: true" in options_yaml(opts, version)
    plain = load_recipe(tmp_path / "r.yaml", ("parallel.attention_dp=false",))
    assert "enable_attention_dp" not in llm_api_options(plain)


@pytest.mark.parametrize(
    "body,message",
    [
        ("target: llmapi\nparallel:\n  attention_dp: true\n", r"parallel\.attention_dp: needs tp > 1 .*; tp is 1$"),
        (
            "target: engine\n" + ADP,
            r"parallel\.attention_dp: is written only into the PyTorch backend's extra_llm_api_options",
        ),
    ],
)
def test_validate_refuses_attention_dp_where_it_cannot_be(hf_dir, tmp_path, body, message):
    import re

    r = _validate(tmp_path, hf_dir, body)
    assert r.exit_code == 2 and any(re.search(message, line) for line in r.output.splitlines()), r.output


def test_validate_refuses_attention_dp_of_a_dense_model(stories_dir, tmp_path):
    r = _validate(tmp_path, stories_dir, "target: llmapi\nparallel:\n  tp: 2\n  attention_dp: true\n")
    assert r.exit_code == 2 and "parallel.attention_dp: LlamaForCausalLM has no experts" in r.output, r.output


# --- the planner --------------------------------------------------------------------------------------------------


def test_plan_of_deepseek_r1_at_attention_dp_8_on_h200():
    """Every GPU holds the whole attention, dense MLPs, shared expert, embedding and lm_head (block FP8: 1 byte per
    projection weight, bf16 norms / embedding / lm_head, float32 router and score bias) and 32 of the 256 experts of
    each MoE layer; the latent cache is 61 x 576 bf16 values per token on each GPU, for its own requests, so the
    deployment holds 8 pools' worth of sequences."""
    from pathlib import Path

    from click.testing import CliRunner

    from trtpipe.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "deepseek-r1-0528-fp8.yaml"
    r = CliRunner().invoke(main, ["plan", str(recipe), "--set", "parallel.attention_dp=true", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.output[r.output.index("{") :])
    h, qa, kvl, rope, nope, v, heads, vocab = 7168, 1536, 512, 64, 128, 128, 128, 129280
    attn = h * qa + h * (kvl + rope) + qa * heads * (nope + rope) + kvl * heads * (nope + v) + heads * v * h
    norms = (qa + kvl + 2 * h) * 2
    dense = 3 * h * 18432
    moe = 3 * h * 2048 * 256 // 8 + 3 * h * 2048 + 256 * (h + 1) * 4
    by_hand = 61 * (attn + norms) + 3 * dense + 58 * moe + vocab * h * 2 + vocab * h * 2 + h * 2
    assert (p["tp"], p["attention_dp"], p["fits"], p["weights_from"]) == (8, True, True, "config.json")
    assert p["weight_bytes_per_gpu"] == by_hand == 101_029_945_344
    assert p["kv_bytes_per_token_per_gpu"] == [61 * 576 * 2]
    assert p["experts"]["experts_per_gpu"] == 32
    assert p["concurrent_sequences"] == 8 * (p["kv_blocks"] // p["blocks_per_sequence"])
    tp8 = json.loads(CliRunner().invoke(main, ["plan", str(recipe), "--json"]).output)
    assert tp8["attention_dp"] is False and tp8["weight_bytes_per_gpu"] < by_hand  # heads split 8 ways there


# --- the predictor ------------------------------------------------------------------------------------------------


def test_mla_generation_attention_is_flash_mla_on_hopper_only():
    """DeepSeek-R1 at attention-DP 8: a generating request's latent attention (128 heads x (576 + 512) x 2 FLOPs per
    cached token per layer, its rank's share of the step) is FlashMLA's work on SM 9.0, timed at 660 of 989 TFLOPS;
    elsewhere (B200) it stays with the other attention kernels (attn_eff). Context attention is unchanged."""
    from trtpipe.formats.gpus import get_gpu
    from trtpipe.perf.cost import FLASH_MLA_DECODE_EFF, Constants, Deployment, group_terms, step_time
    from trtpipe.perf.models import published_spec

    spec = published_spec("DeepSeek R1 0528")
    assert spec.mla and (spec.heads, spec.qk_dim, spec.v_dim, spec.num_layers) == (128, 576, 512, 61)
    flops = 61 * 2 * 128 * (576 + 512) * 4001 / 8  # a request with 4,000 cached tokens: 4,001 keys; one of 8 ranks
    h200 = Deployment(spec, get_gpu("h200-141gb"), "fp8", "fp8", 8, 1, 8, attn_dp=True, pytorch_backend=True)
    t = group_terms(h200, [], [(4000, 1.0)], 1.0)
    assert t.mla_decode == pytest.approx(flops / 989e12, rel=1e-12) and t.attn == 0.0
    ctx = group_terms(h200, [(0, 1000, 1.0)], [], 1.0)  # a context chunk: the fitted attention rate, as before
    assert ctx.mla_decode == 0.0 and ctx.attn > 0
    moved = dataclasses.replace(t, mla_decode=0.0, attn=t.mla_decode)  # the same FLOPs at the fitted attention rate
    same_rate = Constants(attn_eff=FLASH_MLA_DECODE_EFF)
    assert step_time(t, same_rate) == pytest.approx(step_time(moved, same_rate), rel=1e-12)
    assert step_time(t, Constants(attn_eff=0.9)) > step_time(moved, Constants(attn_eff=0.9))
    b200 = Deployment(spec, get_gpu("b200-180gb"), "fp4", "fp8", 4, 1, 4, attn_dp=True, pytorch_backend=True)
    tb = group_terms(b200, [], [(4000, 1.0)], 1.0)
    assert tb.mla_decode == 0.0 and tb.attn == pytest.approx(61 * 2 * 128 * 1088 * 4001 / 4 / 2250e12, rel=1e-12)


def test_recipe_prediction_at_attention_dp_runs_a_scheduler_per_gpu():
    from pathlib import Path

    from trtpipe.app import predictor as P

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "deepseek-r1-0528-fp8.yaml"
    tp8, adp = P.recipe_setup(recipe, []), P.recipe_setup(recipe, ["parallel.attention_dp=true"])
    assert not tp8.deployment.attn_dp and adp.deployment.attn_dp and " attention-DP " in adp.label
    assert adp.max_batch_size == 8 * tp8.max_batch_size and adp.max_num_tokens == 8 * tp8.max_num_tokens


def test_plan_text_says_each_gpu_holds_its_own_pool():
    from pathlib import Path

    from click.testing import CliRunner

    from trtpipe.cli import main

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "deepseek-r1-0528-fp8.yaml"
    out = CliRunner().invoke(main, ["plan", str(recipe), "--set", "parallel.attention_dp=true"]).output
    assert "tp=8 attention-DP pp=1" in out and "on each of 8 GPUs, for its own requests" in out, out
    assert "(max_batch_size 64 per GPU, KV-limited)" in out, out


def test_convert_command_takes_attention_dp(hf_dir, stories_dir, tmp_path):
    from click.testing import CliRunner

    from trtpipe.cli import main

    out = tmp_path / "adp"
    r = CliRunner().invoke(main, ["convert", str(hf_dir), str(out), "--tp", "2", "--moe-ep", "2", "--attention-dp"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["mapping"]["enable_attention_dp"] is True
    dense = CliRunner().invoke(main, ["convert", str(stories_dir), str(tmp_path / "d"), "--tp", "2", "--attention-dp"])
    assert dense.exit_code == 1 and len(dense.output.strip().splitlines()) == 1, dense.output
    assert "needs a mixture-of-experts model at tp > 1" in dense.output and not (tmp_path / "d").exists()
