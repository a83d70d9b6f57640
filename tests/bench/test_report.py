"""``trtpipe report``: rows join the plan, the accuracy status and the newest bench result of each recipe."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from trtpipe.bench.metrics import Request, samples, summarize
from trtpipe.bench.run import FORMAT
from trtpipe.cli import main

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MS = 1_000_000


def _recipe(tmp_path: Path, name: str, stories_dir: Path, quant: str = "") -> Path:
    text = (f"name: {name}\nwork_dir: {tmp_path / name}\nmodel:\n  source: {stories_dir}\n  dtype: float16\n"
            "engine:\n  max_batch_size: 8\n  max_input_len: 256\n  max_seq_len: 512\n  max_num_tokens: 2048\n"
            "accuracy:\n  num_samples: 8\n  seq_len: 64\ntriton:\n  max_batch_size: 8\n" + quant)
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def _result(work: Path, stamp: str, ttft_ms: float) -> None:
    reqs = [Request(0, [int(ttft_ms * MS), int((ttft_ms + 70) * MS)], osl=8) for _ in range(4)]
    m = summarize(reqs)
    run = m.pop("_run")
    out = work / "bench" / stamp
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({
        "format": FORMAT, "label": "c4", "created": stamp, "run": run, "metrics": m, "samples": samples(reqs),
        "load": {"isl": 16, "osl": 8}, "provenance": {"repo": {"engine": "cpu-twin"}}, "server": {"limiter": "none"}}))


def test_report_joins_plan_accuracy_and_the_newest_bench(tmp_path, stories_dir):
    base = _recipe(tmp_path, "base", stories_dir)
    fp8 = _recipe(tmp_path, "q", stories_dir, "quantization:\n  algo: fp8\n  calibration:\n    dataset: self\n")
    _result(tmp_path / "base", "2026-01-01T00:00:00", 30.0)
    _result(tmp_path / "base", "2026-02-01T00:00:00", 10.0)  # newer: this one is reported
    res = CliRunner().invoke(main, ["report", str(base), str(fp8), "--out", str(tmp_path / "rep"), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    b, q = doc["rows"]
    assert b["accuracy"]["gate"] == "baseline" and b["bench"]["ttft_p50"] == 10.0
    assert b["bench"]["itl_p50"] == 10.0 and b["bench"]["engine"] == "cpu-twin"
    assert b["memory"]["status"] == "planned" and b["memory"]["kv_tokens"] > 0
    assert q["memory"]["weight_bytes_per_gpu"] < b["memory"]["weight_bytes_per_gpu"]  # fp8 weights are smaller
    assert q["accuracy"]["status"].startswith("not verified yet (trtpipe build ")
    assert q["bench"]["status"].startswith("not benchmarked")
    assert (tmp_path / "rep" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "q: accuracy: not verified yet" in (tmp_path / "rep" / "report.md").read_text()
