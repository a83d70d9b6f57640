"""A draft quantized by the pipeline with the recipe's algorithm (``speculative.draft_quantization: recipe``), served.

``recipes/stories-int4-awq.yaml`` (INT4 AWQ, group 64, ``*lm_head`` and ``*mlp.proj`` kept float16) with
``speculative.decoding_type: draft_tokens_external`` and the plain stories260k as ``speculative_model``: the
draft_engine stage converts the draft, calibrates it on the recipe's calibration data and quantizes it by the quantize
stage's own functions. The built draft is an INT4 AWQ checkpoint whose tensors are the target's quantize artifact,
byte for byte (same code, same data, same model); the executor serving the target engine's checkpoint with that draft
gives the greedy tokens of no speculation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtpipe.jsonfile import load_json
from trtpipe.runtime import load_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
K = 3
EOS = 2


def _build(tmp, stories_dir, recipe_file, *sets):
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe
    from trtpipe.pipeline.runner import run_build

    text = (ROOT / "recipes" / recipe_file).read_text()
    text = text.replace("../models/stories260k", str(stories_dir)).replace("work_dir: work/", f"work_dir: {tmp}/work/")
    path = tmp / "recipe.yaml"
    path.write_text(text)
    spec = (
        "speculative.decoding_type=draft_tokens_external",
        f"speculative.speculative_model={stories_dir}",
        f"speculative.max_draft_len={K}",
    )
    return run_build(load_recipe(path, (*spec, *sets)), STAGES, until="draft_engine", quiet=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory, stories_dir):
    """INT4 AWQ target and, by the default ``draft_quantization: recipe``, an INT4 AWQ draft."""
    return _build(tmp_path_factory.mktemp("draftq"), stories_dir, "stories-int4-awq.yaml")


@pytest.fixture(scope="module")
def built_float_target(tmp_path_factory, stories_dir):
    """A float32 target (no quantization) and ``draft_quantization: int4_awq``: the recipe's section with that algo."""
    return _build(
        tmp_path_factory.mktemp("draftq-f32"),
        stories_dir,
        "stories-fp16.yaml",
        "model.dtype=float32",
        "speculative.draft_quantization=int4_awq",
        "quantization.group_size=64",
        'quantization.exclude=["*lm_head","*mlp.proj"]',
        "quantization.calibration.num_samples=16",
        "quantization.calibration.seq_len=64",
        "quantization.calibration.device=cpu",
    )


@pytest.fixture(scope="module")
def built_own_settings(tmp_path_factory, stories_dir):
    """A float32 target whose quantization section is untouched (group 128, only ``*lm_head`` excluded, 64 samples)
    and a draft quantized with its own settings: ``draft_quantization`` as a mapping."""
    own = (
        "speculative.draft_quantization={algo: int4_awq, group_size: 64, exclude: ['*lm_head', '*mlp.proj'], "
        "calibration: {num_samples: 8, seq_len: 64, device: cpu}}"
    )
    return _build(tmp_path_factory.mktemp("draftq-own"), stories_dir, "stories-fp16.yaml", "model.dtype=float32", own)


def _draft_checkpoint(built) -> Path:
    return built.artifact("draft_engine") / "engine" / "checkpoint"


def test_the_draft_is_int4_awq_made_by_the_quantize_stage_code(built):
    ckpt = _draft_checkpoint(built)
    q = load_json(ckpt / "config.json")["quantization"]
    assert q["quant_algo"] == "W4A16_AWQ" and q["group_size"] == 64
    draft = load_file(ckpt / "rank0.safetensors")
    plain = load_file(built.artifact("draft_engine") / "checkpoint" / "rank0.safetensors")
    codes = draft["transformer.layers.0.attention.qkv.weight"]
    # INT4 codes packed two a byte: half the float weight's elements, int8 storage; the AWQ scales beside them
    assert codes.dtype == torch.int8 and codes.numel() * 2 == plain["transformer.layers.0.attention.qkv.weight"].numel()
    assert "transformer.layers.0.attention.qkv.weights_scaling_factor" in draft
    assert draft["transformer.layers.0.mlp.proj.weight"].dtype == torch.float16  # excluded: kept float16
    target = load_file(built.artifact("quantize") / "rank0.safetensors")
    assert draft.keys() == target.keys()
    assert [n for n in draft if not torch.equal(draft[n], target[n])] == []


def _serve(model, draft, prompts, n):
    spec = dict(speculative_decoding_type="DraftTarget", max_draft_len=K) if draft is not None else {}
    config = ExecutorConfig(
        max_batch_size=8,
        max_num_tokens=128,
        max_input_len=96,
        max_seq_len=160,
        num_blocks=96,
        tokens_per_block=8,
        **spec,
    )
    final = {}
    core = ExecutorCore(
        config,
        ReferenceEngine(model),
        lambda r: final.__setitem__(r.request_id, r) if r.is_final else None,
        draft_engine=ReferenceEngine(draft) if draft is not None else None,
    )
    reqs = [Request(p, n, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True) for p in prompts]
    ids = [core.submit(r) for r in reqs]
    core.run_until_idle()
    return [final[i] for i in ids]


def test_the_quantized_draft_serves_greedy_tokens_of_no_speculation(built):
    target = load_checkpoint(built.artifact("engine") / "checkpoint")
    draft = load_checkpoint(_draft_checkpoint(built))
    g = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(3, 500, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()]
    prompts += [[1] + torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4)]
    plain = _serve(target, None, prompts, 32)
    spec = _serve(target, draft, prompts, 32)
    accepted = drafted = 0
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens
        assert 0 < b.perf.total_accepted_draft_tokens <= b.perf.total_draft_tokens
        accepted += b.perf.total_accepted_draft_tokens
        drafted += b.perf.total_draft_tokens
    assert accepted == drafted  # the draft's tensors are the target's (above): every greedy draft is the target's token
    print(
        f"\nINT4-AWQ draft quantized by the pipeline, k={K}, {len(prompts)} prompts x 32 tokens: {accepted}/{drafted}"
    )


def test_an_int4_draft_of_an_unquantized_target_serves_its_greedy_tokens(built_float_target):
    """The target float32 as stored; the draft INT4 AWQ (its own calibration): drafts are sometimes rejected, the
    greedy tokens are the target's alone."""
    assert "quantize" not in {s["name"] for s in built_float_target.manifest["stages"] if s["status"] != "skipped"}
    ckpt = _draft_checkpoint(built_float_target)
    assert load_json(ckpt / "config.json")["quantization"]["quant_algo"] == "W4A16_AWQ"
    target_ckpt = built_float_target.artifact("engine") / "checkpoint"
    assert load_json(target_ckpt / "config.json")["quantization"]["quant_algo"] is None
    assert load_file(ckpt / "rank0.safetensors")["transformer.layers.0.attention.qkv.weight"].dtype == torch.int8
    target, draft = load_checkpoint(target_ckpt), load_checkpoint(ckpt)
    g = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(5)]
    plain = _serve(target, None, prompts, 32)
    spec = _serve(target, draft, prompts, 32)
    accepted = drafted = 0
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens
        accepted += b.perf.total_accepted_draft_tokens
        drafted += b.perf.total_draft_tokens
    assert 0 < accepted <= drafted
    print(
        f"\nINT4-AWQ draft (draft_quantization: int4_awq) of a float32 target, k={K}, {len(prompts)} prompts x 32 "
        f"tokens: {accepted}/{drafted} = {accepted / drafted:.3f}"
    )


def test_a_draft_quantized_with_its_own_settings_serves_its_greedy_tokens(built_own_settings):
    """Group 64 and ``*mlp.proj`` excluded (the recipe's section says 128 and only ``*lm_head``), calibrated on 8
    samples of 64 tokens; the greedy tokens are the target's alone."""
    built = built_own_settings
    ckpt = _draft_checkpoint(built)
    q = load_json(ckpt / "config.json")["quantization"]
    assert (q["quant_algo"], q["group_size"]) == ("W4A16_AWQ", 64)
    tensors = load_file(ckpt / "rank0.safetensors")
    assert tensors["transformer.layers.0.attention.qkv.weight"].dtype == torch.int8
    assert tensors["transformer.layers.0.mlp.proj.weight"].dtype == torch.float32  # its own exclude
    stage = next(s for s in built.manifest["stages"] if s["name"] == "draft_engine")
    cal = stage["info"]["calibration"]
    assert (cal["num_samples"], cal["seq_len"], cal["awq_group_size"]) == (8, 64, 64)  # its own calibration
    target_ckpt = built.artifact("engine") / "checkpoint"
    assert load_json(target_ckpt / "config.json")["quantization"]["quant_algo"] is None
    target, draft = load_checkpoint(target_ckpt), load_checkpoint(ckpt)
    g = torch.Generator().manual_seed(6)
    prompts = [[1] + torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4)]
    plain = _serve(target, None, prompts, 24)
    spec = _serve(target, draft, prompts, 24)
    assert [b.tokens for b in spec] == [a.tokens for a in plain]
    accepted = sum(b.perf.total_accepted_draft_tokens for b in spec)
    drafted = sum(b.perf.total_draft_tokens for b in spec)
    assert 0 < drafted and accepted <= drafted
    print(f"\nINT4-AWQ draft, its own settings (group 64), k={K}: {accepted}/{drafted}")
