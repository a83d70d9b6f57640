"""``trtpipe build`` / ``trtpipe status`` through the real CLI (the test stages are passed in by the driver)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trtpipe.pipeline.stages import STAGE_NAMES


def test_build_json_prints_one_object_then_status_verifies(make_recipe, driver, tmp_path):
    path = make_recipe()
    built = driver("build", path, "--json")
    assert built.returncode == 0, built.stderr
    summary = json.loads(built.stdout)  # the whole of stdout is one JSON object
    assert "chatter" not in built.stdout and "child process" not in built.stdout
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("source", "ran"), ("scale", "ran"), ("calib", "skipped"), ("pack", "ran")
    ]
    assert summary["status"] == "ok" and summary["manifest"] == str(tmp_path / "work" / "manifest.json")
    assert "files" not in summary["stages"][0]  # the summary leaves the per-file hashes to manifest.json

    status = driver("status", path, "--json", "--verify")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert [r["state"] for r in report["stages"]] == ["cached", "cached", "skipped", "cached"]
    assert report["verify"] == [] and report["last_build"]["build_id"] == summary["build_id"]

    blob = tmp_path / "work" / summary["stages"][0]["artifact"] / "blob.bin"
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    tampered = driver("status", path, "--verify")
    assert tampered.returncode == 1
    assert f"mismatch: {summary['stages'][0]['artifact']}/blob.bin: sha256 " in tampered.stdout


def test_build_errors_are_one_line_with_exit_codes(make_recipe, driver):
    path = make_recipe()
    bad = driver("build", path, "--force", "nope")
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.strip() == "--force nope: no such stage (stages: source, scale, calib, pack)"

    failed = driver("build", path, "--json", env={"TRTPIPE_TEST_FAIL": "scale"})
    assert failed.returncode == 1
    summary = json.loads(failed.stdout)  # scripts still get the summary of the failed build
    assert summary["status"] == "failed" and summary["stages"][1]["status"] == "failed"
    (line,) = failed.stderr.strip().splitlines()
    log = summary["work_dir"] + "/" + summary["stages"][1]["log"]
    assert line == f"stage scale failed: scale: refused on purpose by the test (log: {log})"


def test_build_without_json_reports_stages_on_stderr(make_recipe, driver, tmp_path):
    built = driver("build", make_recipe(), "--until", "scale")
    assert built.returncode == 0, built.stderr
    assert built.stdout == f"manifest: {tmp_path / 'work' / 'manifest.json'}\n"
    lines = built.stderr.splitlines()
    assert any(line.startswith("source") and " ran in " in line for line in lines)
    assert any(line.startswith("pack") and "skipped: after --until scale" in line for line in lines)


def test_status_of_the_real_stage_table_lists_every_stage_in_order(make_recipe):
    proc = subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", "status", str(make_recipe()), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [r["name"] for r in report["stages"]] == list(STAGE_NAMES)
    assert STAGE_NAMES == ("checkpoint", "calibrate", "quantize", "verify", "engine", "repo")
    for row in report["stages"]:  # a stage either exists (and has a key or a reason) or says why not
        assert row["key"] or row["reason"]
    for name, reason in report["unavailable"].items():
        assert next(r for r in report["stages"] if r["name"] == name)["reason"] == f"not available: {reason}"


@pytest.mark.parametrize("args", [["--verify"]])
def test_status_verify_without_a_build_is_a_one_line_error(make_recipe, driver, args):
    proc = driver("status", make_recipe(), *args)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("manifest.json: no manifest (run `trtpipe build` first)")
    assert len(proc.stderr.strip().splitlines()) == 1
