"""Every stage's key covers every recipe field its writer reads (issue 38 item 6's bug class, for every stage).

Real builds of the tiny model, one per target: ``target: engine`` with INT8 SmoothQuant (checkpoint, calibrate,
quantize, verify, engine, repo) and ``target: llmapi`` with FP8 and an FP8 KV cache (checkpoint, calibrate,
quantize, export, verify, llmapi). Each stage's ``run`` is wrapped in :func:`recipe_reads`; what it read must lie in the sections that enter
its key (its own and, through their keys, its inputs'), or be a field read by its ``extra_key`` / ``files`` (whose
results enter the key), or be declared in ``Stage.unkeyed`` with its reason. Nothing is listed here: the stage table and
the recorder are the sources.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import BaseModel
from recipe_reads import keyed_sections, recipe_reads, unkeyed

from trtpipe.app.stage_table import STAGES
from trtpipe.app.validation import load_recipe
from trtpipe.errors import StageError
from trtpipe.pipeline.runner import run_build

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {
    "engine": ("stories-int8-sq.yaml", {"checkpoint", "calibrate", "quantize", "verify", "engine", "repo"}),
    "llmapi": ("stories-llmapi-fp8.yaml", {"checkpoint", "calibrate", "quantize", "export", "verify", "llmapi"}),
    # the two-model draft-target form: the draft's own engine stage
    "engine-draft": ("stories-fp16.yaml", {"checkpoint", "engine", "draft_engine", "repo"}),
    # the draft quantized with the recipe's INT4 AWQ (speculative.draft_quantization: recipe, the default)
    "engine-draft-int4": (
        "stories-int4-awq.yaml",
        {"checkpoint", "calibrate", "quantize", "verify", "engine", "draft_engine", "repo"},
    ),
    # an unquantized target, the draft INT4 AWQ (speculative.draft_quantization: int4_awq): only the draft calibrates
    "engine-draft-algo": ("stories-fp16.yaml", {"checkpoint", "engine", "draft_engine", "repo"}),
}
# recipe text appended per case (the draft is the model itself)
EXTRA = {
    "engine-draft": "speculative:\n  decoding_type: draft_tokens_external\n  speculative_model: {model}\n",
    "engine-draft-int4": "speculative:\n  decoding_type: draft_tokens_external\n  speculative_model: {model}\n",
    "engine-draft-algo": (
        "speculative:\n  decoding_type: draft_tokens_external\n  speculative_model: {model}\n"
        "  draft_quantization: int4_awq\n"
        'quantization:\n  group_size: 64\n  exclude: ["*lm_head", "*mlp.proj"]\n'
        "  calibration:\n    num_samples: 8\n    seq_len: 32\n    device: cpu\n"
    ),
}


def field_value(recipe, dotted: str):
    value = recipe
    for name in dotted.split("."):
        value = getattr(value, name)
    return value


def recorded_build(tmp_path: Path, recipe_file: str, extra: str = "") -> tuple[dict, dict]:
    """({stage: fields its run read}, {stage: fields its extra_key and files read}) of one real build."""
    text = (ROOT / "recipes" / recipe_file).read_text() + extra.format(model=ROOT / "models" / "stories260k")
    text = text.replace("../models/stories260k", str(ROOT / "models" / "stories260k"))
    text = text.replace("work_dir: work/", f"work_dir: {tmp_path}/work/")
    path = tmp_path / recipe_file
    path.write_text(text)
    recipe = load_recipe(path, (), check_rules=False)
    run_reads, key_reads = {}, {}
    for stage in STAGES:
        with recipe_reads(recipe) as r:
            if stage.enabled(recipe):
                stage.extra_key(recipe)
                stage.files(recipe)
        # fields only: a section touched whole (the engine's extra_key asks which kv_cache fields were written)
        # does not put the section's values into the key
        key_reads[stage.name] = {f for f in r if not isinstance(field_value(recipe, f), BaseModel)}

    def wrap(stage):
        def run(ctx):
            assert ctx.recipe is recipe  # the recorder follows this object's sections
            with recipe_reads(ctx.recipe) as r:
                stage.run(ctx)
            run_reads[stage.name] = r

        return dataclasses.replace(stage, run=run)

    run_build(recipe, tuple(wrap(s) for s in STAGES), quiet=True)
    return run_reads, key_reads


@pytest.mark.parametrize("target", sorted(RECIPES))
def test_every_stage_keys_what_its_writer_reads(tmp_path, target):
    recipe_file, expected = RECIPES[target]
    run_reads, key_reads = recorded_build(tmp_path, recipe_file, EXTRA.get(target, ""))
    assert set(run_reads) == expected  # every stage of this target ran (and was recorded)
    problems = {}
    for stage in STAGES:
        if stage.name not in run_reads:
            continue
        reads = run_reads[stage.name]
        missing = unkeyed(reads, [*keyed_sections(stage, STAGES), *key_reads[stage.name], *stage.unkeyed])
        stale_exemptions = [f for f in stage.unkeyed if f not in reads]
        if missing or stale_exemptions:
            problems[stage.name] = {"unkeyed reads": missing, "declared unkeyed but not read": stale_exemptions}
    assert problems == {}


def test_a_changed_kv_fraction_rewrites_the_repository_not_the_engine(tmp_path):
    """The KV pool is planned where engine.kv_cache is keyed: a fraction too small for one sequence is refused by
    the repo stage even when the engine comes from the cache (before, the engine stage planned it and a cached
    engine skipped the check)."""
    recipe_file = "stories-fp16.yaml"
    text = (ROOT / "recipes" / recipe_file).read_text()
    text = text.replace("../models/stories260k", str(ROOT / "models" / "stories260k"))
    text = text.replace("work_dir: work/", f"work_dir: {tmp_path}/work/")
    path = tmp_path / recipe_file
    path.write_text(text)
    first = run_build(load_recipe(path, (), check_rules=False), STAGES, quiet=True)
    assert (
        first.stage("repo")["info"]["kv_plan"]["kv_blocks"]
        >= first.stage("engine")["info"]["plan"]["blocks_per_sequence"]
    )
    tiny = ("engine.kv_cache.free_gpu_memory_fraction=0.0000001",)
    with pytest.raises(StageError) as err:
        run_build(load_recipe(path, tiny, check_rules=False), STAGES, quiet=True)
    second = err.value.result
    status = {s["name"]: s["status"] for s in second.manifest["stages"]}
    assert status["engine"] == "cached" and status["repo"] == "failed"
    assert "cannot hold one sequence of max_seq_len" in second.stage("repo")["error"]
