"""Builds killed with SIGKILL: nothing half-written looks complete, the next build resumes, the lock holds."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from pipeline_test_stages import STAGES, tree_hashes

from trtpipe.pipeline.cache import MARKER, BuildLockedError
from trtpipe.pipeline.runner import run_build
from trtpipe.app.validation import load_recipe


def wait_for(flag: Path, proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(f"build exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError("the build never reached the blocking point")
        time.sleep(0.05)


def kill9(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def outputs(work: Path) -> dict[str, dict[str, str]]:
    """``{stage: file hashes}`` of each stage's artifact folder(s), marker left out; asserts one per stage."""
    out = {}
    for stage_dir in sorted((work / "artifacts").iterdir()):
        finals = [p for p in stage_dir.iterdir() if not p.name.startswith(".")]
        assert len(finals) == 1, finals
        hashes = tree_hashes(finals[0])
        hashes.pop(MARKER)
        out[stage_dir.name] = hashes
    return out


def assert_every_final_folder_is_complete(work: Path) -> int:
    """Every non-hidden artifact folder has a marker that matches its files byte for byte. Returns the count."""
    count = 0
    for folder in (work / "artifacts").glob("*/*"):
        if folder.name.startswith("."):
            continue
        marker = json.loads((folder / MARKER).read_text())
        hashes = tree_hashes(folder)
        hashes.pop(MARKER)
        assert hashes == {rel: meta["sha256"] for rel, meta in marker["files"].items()}, folder
        count += 1
    return count


def build_json(driver, recipe: Path, env=None, **kwargs) -> dict:
    """Build in a child process (``run_build`` with the test stages); return the manifest summary."""
    proc = driver("lib", recipe, json.dumps(kwargs), env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_sigkill_mid_stage_then_rerun_gives_the_same_artifacts(make_recipe, driver, tmp_path):
    reference = build_json(driver, make_recipe("ref", work_dir="ref"))
    assert [s["status"] for s in reference["stages"]] == ["ran", "ran", "skipped", "ran"]

    path = make_recipe("r", work_dir="work")
    work = tmp_path / "work"
    flag = tmp_path / "scale-is-half-written"
    proc = driver("lib", path, "{}", env={"TRTPIPE_TEST_BLOCK": f"scale:{flag}"}, wait=False)
    wait_for(flag, proc)

    # While it runs, a second build of the same work dir is refused with a clear one-line error.
    with pytest.raises(BuildLockedError) as info:
        run_build(load_recipe(path, check_rules=False), STAGES, quiet=True)
    assert re.fullmatch(
        rf"{work}: another build is running here \(pid {proc.pid} since [0-9T:-]+Z\); "
        "wait for it to finish or use another work_dir",
        str(info.value),
    )

    kill9(proc)
    scale_dir = work / "artifacts" / "scale"
    assert [p.name for p in scale_dir.iterdir() if not p.name.startswith(".")] == []  # nothing looks complete
    (tmp,) = [p for p in scale_dir.iterdir() if p.name.startswith(".tmp-")]
    full_size = (tmp_path / "ref" / reference["stages"][1]["artifact"] / "scaled.bin").stat().st_size
    assert 0 < (tmp / "scaled.bin").stat().st_size < full_size and not (tmp / MARKER).exists()
    assert not (work / "manifest.json").exists()
    assert assert_every_final_folder_is_complete(work) == 1  # source finished before the kill

    resumed = build_json(driver, path)
    assert [s["status"] for s in resumed["stages"]] == ["cached", "ran", "skipped", "ran"]
    assert not tmp.exists() and [p.name for p in scale_dir.iterdir()] == [resumed["stages"][1]["key"]]
    assert [s["key"] for s in resumed["stages"]] == [s["key"] for s in reference["stages"]]
    assert outputs(work) == outputs(tmp_path / "ref")
    manifest = json.loads((work / "manifest.json").read_text())
    assert any(line.startswith("removed stale") and ".tmp-" in line for line in manifest["cleaned"])


@pytest.mark.slow
def test_killed_at_random_moments_never_leaves_a_complete_looking_partial(make_recipe, driver, tmp_path):
    """Kill ``--force all`` builds at random times (writes are slowed); check the invariant after each kill."""
    build_json(driver, make_recipe("ref", work_dir="ref"))
    path = make_recipe("r", work_dir="work")
    work = tmp_path / "work"
    build_json(driver, path)
    slow = {"TRTPIPE_TEST_DELAY": "0.3"}  # each stage sleeps 0.3 s after its first chunk
    started = time.monotonic()
    build_json(driver, path, env=slow, force=["all"])
    duration = time.monotonic() - started
    rng = random.Random(1)
    kills = 0
    for _ in range(5):
        proc = driver("lib", path, json.dumps({"force": ["all"]}), env=slow, wait=False)
        time.sleep(rng.uniform(0.2, duration))
        if proc.poll() is None:
            kill9(proc)
            kills += 1
        else:
            proc.communicate()
        assert_every_final_folder_is_complete(work)
    assert kills >= 3
    final = build_json(driver, path)
    assert all(s["status"] in ("cached", "ran", "skipped") for s in final["stages"])
    assert outputs(work) == outputs(tmp_path / "ref")
    assert sorted(p.name for p in (work / "artifacts").glob("*/.*")) == []
