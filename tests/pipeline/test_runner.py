"""The runner with real test stages: caching, --force, --from/--until, disabled stages, failures, manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pipeline_test_stages import CHILD_ALLOC_MIB, STAGES, tree_hashes

from trtpipe.errors import StageError
from trtpipe.pipeline.cache import MARKER
from trtpipe.pipeline.manifest import load_manifest, verify_manifest
from trtpipe.pipeline.runner import StageSelectionError, run_build
from trtpipe.app.validation import load_recipe

FP8 = "quantization:\n  algo: fp8\n  calibration:\n    num_samples: 4\n    seq_len: 16\n"


def build(path: Path, *overrides: str, **kwargs):
    recipe = load_recipe(path, overrides, check_rules=False)
    return run_build(recipe, STAGES, quiet=True, overrides=overrides, **kwargs)


def statuses(result) -> dict[str, str]:
    return {s["name"]: s["status"] for s in result.manifest["stages"]}


def artifact_hashes(result) -> dict[str, dict]:
    """Output files of every built stage (without the marker, which records when and by which build)."""
    out = {}
    for stage in result.manifest["stages"]:
        if "files" in stage:
            out[stage["name"]] = tree_hashes(result.artifact(stage["name"]))
            assert out[stage["name"]].pop(MARKER)
    return out


def leftovers(work: Path) -> list[str]:
    return sorted(p.name for p in (work / "artifacts").glob("*/.*"))


def test_second_build_is_all_cached_and_identical(make_recipe):
    path = make_recipe(body=FP8)
    first = build(path)
    assert statuses(first) == {"source": "ran", "scale": "ran", "calib": "ran", "pack": "ran"}
    second = build(path)
    assert statuses(second) == {"source": "cached", "scale": "cached", "calib": "cached", "pack": "cached"}
    assert artifact_hashes(first) == artifact_hashes(second)
    assert second.stage("pack")["built_by"] == first.manifest["build_id"]
    assert second.stage("pack")["info"] == {"inputs": ["calib", "scale"]}
    assert leftovers(path.parent / "work") == []


def test_manifest_sha256_values_match_the_files(make_recipe):
    path = make_recipe(body=FP8)
    result = build(path)
    manifest = load_manifest(result.manifest_path)
    assert manifest == json.loads((path.parent / "work" / "manifests" / f"{manifest['build_id']}.json").read_text())
    for stage in manifest["stages"]:
        on_disk = tree_hashes(result.artifact(stage["name"]))
        on_disk.pop(MARKER)
        assert {rel: meta["sha256"] for rel, meta in stage["files"].items()} == on_disk
        assert all(
            meta["size"] == (result.artifact(stage["name"]) / rel).stat().st_size
            for rel, meta in stage["files"].items()
        )
    assert verify_manifest(result.manifest_path) == []
    assert manifest["recipe"]["text"] == path.read_text()
    assert manifest["resolved"]["quantization"]["calibration"]["num_samples"] == 4
    assert manifest["versions"]["python"] and manifest["versions"]["trtpipe"] == "0.1.0"
    assert set(manifest["versions"]) >= {
        "torch",
        "transformers",
        "tensorrt_llm",
        "tensorrt",
        "cuda",
        "driver",
        "gpu_compute_capability",
    }


@pytest.mark.slow
def test_manifest_records_wall_time_and_peak_rss_per_stage(make_recipe, monkeypatch):
    # The children's peak is sampled: on a loaded machine the sampler thread can sleep through a 0.3 s child,
    # so the child holds its memory for 2 s here (the assertion stays exact).
    monkeypatch.setenv("TRTPIPE_TEST_CHILD_HOLD_S", "2.0")
    result = build(make_recipe())
    pack = result.stage("pack")
    assert pack["wall_s"] > 0.3  # its child sleeps 0.3 s
    # The child touched every page of its buffer; a python interpreter adds well under 60 MiB. (A reading near
    # the parent's own size would mean the fork-time sharing was counted.)
    assert CHILD_ALLOC_MIB << 20 <= pack["peak_rss_children_bytes"] < (CHILD_ALLOC_MIB + 60) << 20
    assert pack["peak_rss_self_bytes"] > 10 << 20
    assert pack["peak_rss_bytes"] == pack["peak_rss_self_bytes"] + pack["peak_rss_children_bytes"]
    assert result.manifest["peak_rss_bytes"] >= pack["peak_rss_bytes"]


def test_verify_manifest_reports_changed_missing_and_added_files(make_recipe):
    result = build(make_recipe())
    scaled = result.artifact("scale") / "scaled.bin"
    data = bytearray(scaled.read_bytes())
    data[10] ^= 0xFF
    scaled.write_bytes(bytes(data))
    (result.artifact("source") / "meta" / "names.json").unlink()
    (result.artifact("pack") / "stray.txt").write_text("added later")
    problems = sorted(str(m) for m in verify_manifest(result.manifest_path))
    keys = {stage: result.stage(stage)["artifact"] for stage in ("source", "scale", "pack")}
    assert len(problems) == 3
    assert f"{keys['source']}/meta/names.json: missing" in problems
    assert any(p.startswith(f"{keys['scale']}/scaled.bin: sha256 ") for p in problems)
    assert f"{keys['pack']}/stray.txt: not in the manifest" in problems


@pytest.mark.slow
def test_force_reruns_one_stage_and_replaces_its_artifact(make_recipe):
    path = make_recipe()
    first = build(path)
    old = first.artifact("scale")
    inode = old.stat().st_ino
    forced = build(path, force=["scale"])
    assert statuses(forced) == {"source": "cached", "scale": "ran", "calib": "skipped", "pack": "cached"}
    assert forced.artifact("scale") == old and old.stat().st_ino != inode  # a new folder, renamed into place
    assert artifact_hashes(forced) == artifact_hashes(first)
    assert leftovers(path.parent / "work") == []
    assert statuses(build(path, force=["all"])) == {"source": "ran", "scale": "ran", "calib": "skipped", "pack": "ran"}


def test_until_and_from_bound_the_run(make_recipe):
    path = make_recipe()
    with pytest.raises(StageSelectionError, match=r"--from pack: earlier stages are not built yet \(source, scale\)"):
        build(path, from_stage="pack")
    partial = build(path, until="scale")
    assert statuses(partial) == {"source": "ran", "scale": "ran", "calib": "skipped", "pack": "skipped"}
    assert partial.stage("pack")["reason"] == "after --until scale"
    assert not (path.parent / "work" / "artifacts" / "pack").exists()
    rest = build(path, from_stage="scale")
    assert statuses(rest) == {"source": "cached", "scale": "ran", "calib": "skipped", "pack": "ran"}
    only = build(path, from_stage="scale", until="scale")
    assert statuses(only) == {"source": "cached", "scale": "ran", "calib": "skipped", "pack": "skipped"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"force": ["nope"]}, "--force nope: no such stage (stages: source, scale, calib, pack)"),
        ({"force": ["calib"]}, "--force calib: stage is disabled by the recipe"),
        ({"from_stage": "pack", "until": "scale"}, "--from pack comes after --until scale"),
        ({"until": "bogus"}, "--until bogus: no such stage"),
    ],
)
def test_bad_selection_is_one_line_and_builds_nothing(make_recipe, kwargs, message):
    path = make_recipe()
    with pytest.raises(StageSelectionError) as info:
        build(path, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (path.parent / "work" / "artifacts").exists()


def test_disabled_stage_is_skipped_and_not_an_input(make_recipe):
    path = make_recipe()
    result = build(path)
    assert result.stage("calib") == {
        "name": "calib",
        "key": None,
        "status": "skipped",
        "reason": "disabled by the recipe",
    }
    assert result.stage("pack")["info"] == {"inputs": ["scale"]}
    quantized = build(path, "quantization.algo=fp8")
    assert quantized.manifest["recipe"]["overrides"] == ["quantization.algo=fp8"]
    assert quantized.manifest["resolved"]["quantization"]["algo"] == "fp8"
    assert quantized.stage("pack")["info"] == {"inputs": ["calib", "scale"]}
    assert quantized.stage("pack")["key"] != result.stage("pack")["key"]


def test_failed_stage_raises_one_line_error_naming_stage_and_log(make_recipe, monkeypatch):
    path = make_recipe()
    build(path, until="source")
    monkeypatch.setenv("TRTPIPE_TEST_FAIL", "scale")
    with pytest.raises(StageError) as info:
        build(path)
    message = str(info.value)
    log = path.parent / "work" / info.value.result.stage("scale")["log"]
    assert message == f"stage scale failed: scale: refused on purpose by the test (log: {log})"
    assert "Traceback" in log.read_text() and "refused on purpose" in log.read_text()
    manifest = load_manifest(path.parent / "work" / "manifest.json")
    assert manifest["status"] == "failed" and manifest["error"] == message
    assert {s["name"]: s["status"] for s in manifest["stages"]} == {
        "source": "cached",
        "scale": "failed",
        "calib": "skipped",
        "pack": "skipped",
    }
    assert list((path.parent / "work" / "artifacts" / "scale").iterdir()) == []  # the temp folder is gone too
    monkeypatch.delenv("TRTPIPE_TEST_FAIL")
    assert statuses(build(path))["scale"] == "ran"


def test_a_python_bug_in_a_stage_is_also_a_stage_error(make_recipe, monkeypatch):
    path = make_recipe()
    monkeypatch.setenv("TRTPIPE_TEST_DELAY", "soon")  # float("soon") raises ValueError inside the source stage
    with pytest.raises(StageError) as info:
        build(path)
    assert str(info.value).startswith("stage source failed: ValueError: could not convert string to float: 'soon'")
    assert "\n" not in str(info.value)
    assert list((path.parent / "work" / "artifacts" / "source").iterdir()) == []


def test_ctrl_c_inside_begin_leaves_no_temporary_folder(make_recipe, monkeypatch):
    """The signal can land after begin()'s mkdir and before the runner holds the path (seen under load)."""
    from trtpipe.pipeline.cache import ArtifactStore

    path = make_recipe()
    real_begin = ArtifactStore.begin

    def begin_then_interrupted(self, stage, key):
        real_begin(self, stage, key)
        raise KeyboardInterrupt

    monkeypatch.setattr(ArtifactStore, "begin", begin_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(path)
    assert leftovers(path.parent / "work") == []
    manifest = load_manifest(path.parent / "work" / "manifest.json")
    assert manifest["status"] == "interrupted"


@pytest.mark.parametrize("damage", ["no marker", "truncated file", "marker of another key", "garbage marker"])
def test_half_written_or_damaged_artifact_is_never_reused(make_recipe, damage):
    path = make_recipe()
    good = build(path)
    expected = artifact_hashes(good)
    folder = good.artifact("scale")
    marker = folder / MARKER
    if damage == "no marker":
        marker.unlink()
    elif damage == "truncated file":
        with open(folder / "scaled.bin", "r+b") as f:
            f.truncate(100)
    elif damage == "marker of another key":
        data = json.loads(marker.read_text())
        data["key"] = "0" * 16
        marker.write_text(json.dumps(data))
    else:
        marker.write_text('{"stage": "scale", "key": ')
    again = build(path)
    assert statuses(again)["scale"] == "ran"
    assert artifact_hashes(again) == expected
    assert leftovers(path.parent / "work") == []


def test_killed_between_the_two_renames_of_a_force_restores_the_old_artifact(make_recipe):
    """--force moves the old folder aside before moving the new one in; a kill in between leaves it whole."""
    path = make_recipe()
    good = build(path)
    folder = good.artifact("scale")
    aside = folder.parent / f".old-{folder.name}-12345-abcd"
    os.rename(folder, aside)  # the exact state a SIGKILL between the renames leaves
    again = build(path)
    assert statuses(again)["scale"] == "cached"
    assert any("restored" in line for line in again.manifest["cleaned"])
    assert artifact_hashes(again) == artifact_hashes(good)
    assert leftovers(path.parent / "work") == []


def test_logs_per_build_and_per_stage(make_recipe):
    path = make_recipe()
    result = build(path)
    logs = path.parent / "work" / "logs" / result.manifest["build_id"]
    assert sorted(p.name for p in logs.iterdir()) == ["build.log", "pack.log", "scale.log", "source.log"]
    source_log = (logs / "source.log").read_text()
    assert "chatter on stdout" in source_log and "a child process writing to fd 1" in source_log
    assert "stage source, key" in (logs / "build.log").read_text()


def test_half_written_manifest_temp_files_are_cleaned(make_recipe):
    path = make_recipe()
    work = path.parent / "work"
    build(path)
    stale = [work / ".tmp-manifest.json-999-abcd", work / "manifests" / ".tmp-x.json-999-abcd"]
    for file in stale:
        file.write_text('{"format": 1, "stag')  # what a kill during a manifest write leaves
    again = build(path)
    assert not any(f.exists() for f in stale)
    assert sorted(again.manifest["cleaned"]) == sorted(f"removed stale {f}" for f in stale)
    assert verify_manifest(again.manifest_path) == []


def test_asking_for_the_artifact_of_a_skipped_stage_is_a_clear_error(make_recipe):
    result = build(make_recipe(), until="scale")
    assert result.artifact("scale").is_dir()
    with pytest.raises(StageError, match=r"^stage calib has no artifact in this build \(disabled by the recipe\)$"):
        result.artifact("calib")
    with pytest.raises(StageError, match=r"^stage pack has no artifact in this build \(after --until scale\)$"):
        result.artifact("pack")


def test_gc_lists_then_deletes_only_what_neither_the_recipe_nor_the_last_build_uses(make_recipe):
    from trtpipe.pipeline.runner import collect_garbage

    path = make_recipe(body=FP8)
    first = build(path)
    other = build(path, "quantization.calibration.seq_len=32")  # new scale, calib and pack keys (source is shared)
    old = {s: other.artifact(s) for s in ("scale", "calib", "pack")}
    assert other.artifact("source") == first.artifact("source")
    build(path)  # the last manifest is the first recipe again
    stale = path.parent / "work" / "artifacts" / "pack" / ".tmp-deadbeef-1-0"
    stale.mkdir()
    recipe = load_recipe(path, check_rules=False)

    listed = collect_garbage(recipe, STAGES)
    assert sorted(u["artifact"] for u in listed["unused"]) == sorted(
        str(p.relative_to(path.parent / "work")) for p in old.values()
    )
    assert listed["bytes"] == sum(f.stat().st_size for p in old.values() for f in p.rglob("*") if f.is_file())
    assert not listed["deleted"] and all(p.is_dir() for p in old.values()) and stale.is_dir()

    deleted = collect_garbage(recipe, STAGES, delete=True)
    assert deleted["deleted"] and not any(p.exists() for p in old.values()) and not stale.exists()
    again = build(path)
    assert set(statuses(again).values()) == {"cached"}
    assert artifact_hashes(again) == artifact_hashes(first)
    assert collect_garbage(recipe, STAGES)["unused"] == []


def test_gc_keeps_what_the_last_build_used(make_recipe):
    from trtpipe.pipeline.runner import collect_garbage

    path = make_recipe(body=FP8)
    build(path)
    other = build(path, "quantization.calibration.seq_len=32")  # the last manifest: a server may serve it
    report = collect_garbage(load_recipe(path, check_rules=False), STAGES, delete=True)
    assert report["unused"] == [] and other.artifact("pack").is_dir()


def test_gc_cli_lists_without_deleting(make_recipe, driver):
    path = make_recipe(body=FP8)
    build(path)
    build(path, "quantization.calibration.seq_len=32")
    build(path)
    listed = driver("gc", str(path))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [l.split()[0] for l in lines[:-1]] == ["unused"] * 3  # scale, calib and pack of the other settings
    assert lines[-1].startswith("unused 3 artifacts,") and lines[-1].endswith("(trtpipe gc RECIPE --delete frees them)")
    deleted = driver("gc", str(path), "--delete")
    assert deleted.returncode == 0, deleted.stderr
    assert deleted.stdout.splitlines()[-1].startswith("deleted 3 artifacts,")
    assert driver("gc", str(path)).stdout.strip() == "unused 0 artifacts, 0.00 GiB"
