"""Content keys change exactly when something a stage declared changes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pipeline_test_stages import STAGES

from trtpipe.pipeline.keys import SMALL_FILE_BYTES, canonical, fingerprint, stable_json
from trtpipe.pipeline.runner import plan_build
from trtpipe.app.validation import load_recipe


def keys(recipe_path: Path, *overrides: str) -> dict[str, str]:
    plans = plan_build(load_recipe(recipe_path, overrides, check_rules=False), STAGES)
    return {p.name: p.key for p in plans}


def test_keys_are_stable_across_loads(make_recipe):
    path = make_recipe(body="quantization:\n  algo: fp8\n")
    first, second = keys(path), keys(path)
    assert first == second
    assert all(len(k) == 16 for k in first.values())
    assert len(set(first.values())) == 4


def test_undeclared_section_does_not_change_any_key(make_recipe):
    path = make_recipe(body="quantization:\n  algo: fp8\n")
    before = keys(path)
    assert keys(path, "triton.model_name=other", "accuracy.num_samples=3", "parallel.moe_ep=2") == before


def test_writing_a_default_explicitly_keeps_the_key(make_recipe):
    """Keys hash the resolved section (defaults filled), not the text as written."""
    assert keys(make_recipe("a")) == keys(make_recipe("b", body="engine:\n  max_batch_size: 64\n"))


def test_declared_section_changes_that_stage_and_everything_downstream(make_recipe):
    path = make_recipe(body="quantization:\n  algo: fp8\n")
    before = keys(path)
    after = keys(path, "quantization.calibration.num_samples=5")
    # calib declares quantization.calibration; scale declares all of quantization; pack reads both.
    assert after["source"] == before["source"]
    assert after["calib"] != before["calib"]
    assert after["scale"] != before["scale"]
    assert after["pack"] != before["pack"]
    engine_only = keys(path, "engine.max_batch_size=8")
    assert {n: engine_only[n] == before[n] for n in before} == {
        "source": True,
        "scale": True,
        "calib": True,
        "pack": False,
    }


def test_upstream_key_change_propagates(make_recipe):
    path = make_recipe(body="quantization:\n  algo: fp8\n")
    before = keys(path)
    after = keys(path, "model.dtype=float16")  # only source declares model
    assert all(after[n] != before[n] for n in before)


def test_small_input_file_content_changes_the_key(make_recipe, model_dir):
    path = make_recipe()
    before = keys(path)
    cfg = model_dir / "config.json"
    st = cfg.stat()
    text = cfg.read_text()
    cfg.write_text(text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert cfg.read_text() != text and cfg.stat().st_size == st.st_size
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the content differs
    after = keys(path)
    assert after["source"] != before["source"]
    assert after["scale"] != before["scale"]


def test_big_input_file_is_fingerprinted_by_size_and_mtime(make_recipe, model_dir):
    path = make_recipe()
    big = model_dir / "extra.bin"
    assert big.stat().st_size > SMALL_FILE_BYTES
    entry = next(e for e in fingerprint(model_dir)["dir"] if e["path"] == "extra.bin")
    assert "sha256" not in entry and entry["size"] == big.stat().st_size
    before = keys(path)
    st = big.stat()
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert keys(path)["source"] != before["source"]


def test_new_or_hidden_files_in_an_input_dir(make_recipe, model_dir):
    path = make_recipe()
    before = keys(path)
    (model_dir / ".cache").mkdir()
    (model_dir / ".cache" / "lock").write_text("hub lock files come and go")
    assert keys(path) == before
    (model_dir / "added.txt").write_text("x")
    assert keys(path)["source"] != before["source"]


def test_missing_input_path_is_recorded_not_raised(tmp_path):
    assert fingerprint(tmp_path / "nope") == {"path": str(tmp_path / "nope"), "missing": True}


def test_canonical_json_is_order_independent_and_refuses_unstable_objects():
    assert stable_json({"b": 1, "a": {2, 1}, "p": Path("/x")}) == stable_json({"p": "/x", "a": [1, 2], "b": 1})
    with pytest.raises(TypeError, match="object"):
        canonical({"x": object()})


def test_extra_key_and_trtpipe_version_enter_the_key(make_recipe, monkeypatch):
    import dataclasses

    import trtpipe.pipeline.keys as keys_module

    recipe = load_recipe(make_recipe(), check_rules=False)
    source = STAGES[0]
    base, _ = keys_module.stage_key(source, recipe, {})
    other_tool = dataclasses.replace(source, extra_key=lambda r: {"tensorrt_llm": "1.2.1"})
    assert keys_module.stage_key(other_tool, recipe, {})[0] != base
    monkeypatch.setattr(keys_module, "__version__", "9.9.9")
    assert keys_module.stage_key(source, recipe, {})[0] != base


def test_a_serving_setting_the_repository_carries_changes_the_repo_key():
    """Issue 38 item 6: serving.request_timeout_s is written into the repository (the twin's executor_extras), so a
    new value, up or down, must be a new repository, not the cached one; the engine below it is unchanged."""
    from trtpipe.app.stage_table import STAGES as BUILD_STAGES

    def real_keys(*overrides):
        recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "stories-fp16.yaml", list(overrides))
        return {p.name: p.key for p in plan_build(recipe, BUILD_STAGES)}

    base, longer, shorter = (real_keys(f"serving.request_timeout_s={t}") for t in (30, 60, 5))
    assert len({base["repo"], longer["repo"], shorter["repo"]}) == 3
    assert base["engine"] == longer["engine"] == shorter["engine"]
