"""``trtpipe build`` / ``trtpipe status`` through the real CLI (the test stages are passed in by the driver)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from pipeline_test_stages import STAGES

from trtpipe.cli import main
from trtpipe.app.stage_table import STAGE_NAMES
from optional import needs


def cli(*args, env=None, stages=STAGES):
    """The real CLI in this process (fast); ``stages=None`` uses the real stage table."""
    result = CliRunner().invoke(main, [str(a) for a in args], obj={"stages": stages}, env=env)
    return result.exit_code, result.stdout, result.stderr


def test_build_json_prints_one_object_then_status_verifies(make_recipe, driver, tmp_path):
    path = make_recipe()
    built = driver("build", path, "--json")  # a real process: stage output written to fd 1 must not leak
    assert built.returncode == 0, built.stderr
    summary = json.loads(built.stdout)  # the whole of stdout is one JSON object
    assert "chatter" not in built.stdout and "child process" not in built.stdout
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [
        ("source", "ran"),
        ("scale", "ran"),
        ("calib", "skipped"),
        ("pack", "ran"),
    ]
    assert summary["status"] == "ok" and summary["manifest"] == str(tmp_path / "work" / "manifest.json")
    assert "files" not in summary["stages"][0]  # the summary leaves the per-file hashes to manifest.json

    code, out, err = cli("status", path, "--json", "--verify")
    assert code == 0, err
    report = json.loads(out)
    assert [r["state"] for r in report["stages"]] == ["cached", "cached", "skipped", "cached"]
    assert report["verify"] == [] and report["last_build"]["build_id"] == summary["build_id"]

    blob = tmp_path / "work" / summary["stages"][0]["artifact"] / "blob.bin"
    blob.write_bytes(blob.read_bytes()[:-1] + b"\0")
    code, out, err = cli("status", path, "--verify")
    assert code == 1
    assert f"mismatch: {summary['stages'][0]['artifact']}/blob.bin: sha256 " in out


def test_build_errors_are_one_line_with_exit_codes(make_recipe):
    path = make_recipe()
    code, out, err = cli("build", path, "--force", "nope")
    assert (code, out) == (2, "")
    assert err.strip() == "--force nope: no such stage (stages: source, scale, calib, pack)"

    code, out, err = cli("build", path, "--json", env={"TRTPIPE_TEST_FAIL": "scale"})
    assert code == 1
    summary = json.loads(out)  # scripts still get the summary of the failed build
    assert summary["status"] == "failed" and summary["stages"][1]["status"] == "failed"
    (line,) = err.strip().splitlines()
    log = summary["work_dir"] + "/" + summary["stages"][1]["log"]
    assert line == f"stage scale failed: scale: refused on purpose by the test (log: {log})"


def test_build_without_json_reports_stages_on_stderr(make_recipe, tmp_path):
    code, out, err = cli("build", make_recipe(), "--until", "scale")
    assert code == 0, err
    assert out == f"manifest: {tmp_path / 'work' / 'manifest.json'}\n"
    lines = err.splitlines()
    assert any(line.startswith("source") and " ran in " in line for line in lines)
    assert any(line.startswith("pack") and "skipped: after --until scale" in line for line in lines)


@needs("tritonclient")
def test_status_of_the_real_stage_table_lists_every_stage_in_order(make_recipe):
    code, out, err = cli("status", make_recipe(), "--json", stages=None)
    assert code == 0, err
    report = json.loads(out)
    assert [r["name"] for r in report["stages"]] == list(STAGE_NAMES)
    assert STAGE_NAMES == (
        "checkpoint",
        "calibrate",
        "quantize",
        "export",
        "verify",
        "llmapi",
        "engine",
        "draft_engine",
        "repo",
    )
    for row in report["stages"]:  # a stage has a key, or the reason it does not run
        assert row["key"] or row["reason"]


def test_status_verify_without_a_build_is_a_one_line_error(make_recipe, tmp_path):
    code, out, err = cli("status", make_recipe(), "--verify")
    assert code == 1
    assert err == f"{tmp_path / 'work' / 'manifest.json'}: no manifest (run `trtpipe build` first)\n"
