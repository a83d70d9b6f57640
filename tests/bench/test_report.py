"""``trtpipe report``: rows join the plan, the accuracy status and the newest bench result of each recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.bench.metrics import Request, samples, summarize
from trtpipe.bench.run import FORMAT
from trtpipe.cli import main
from optional import needs

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MS = 1_000_000


def _recipe(tmp_path: Path, name: str, stories_dir: Path, quant: str = "") -> Path:
    text = (
        f"name: {name}\nwork_dir: {tmp_path / name}\nmodel:\n  source: {stories_dir}\n  dtype: float16\n"
        "engine:\n  max_batch_size: 8\n  max_input_len: 256\n  max_seq_len: 512\n  max_num_tokens: 2048\n"
        "accuracy:\n  num_samples: 8\n  seq_len: 64\ntriton:\n  max_batch_size: 8\n" + quant
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def _result(work: Path, stamp: str, ttft_ms: float) -> None:
    reqs = [Request(0, [int(ttft_ms * MS), int((ttft_ms + 70) * MS)], osl=8) for _ in range(4)]
    m = summarize(reqs)
    run = m.pop("_run")
    out = work / "bench" / stamp
    out.mkdir(parents=True)
    (out / "result.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "label": "c4",
                "created": stamp,
                "run": run,
                "metrics": m,
                "samples": samples(reqs),
                "load": {"isl": 16, "osl": 8},
                "provenance": {"repo": {"engine": "cpu-twin"}},
                "server": {"limiter": "none"},
            }
        )
    )


@needs("matplotlib")
@pytest.mark.slow
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


def _verified(rows, gate="pass"):
    return {
        "status": "verified",
        "rows": rows,
        "gate": gate,
        "source": "this recipe's verify artifact",
        "eval": {"eval_data": "self", "num_samples": 8, "seq_len": 64},
        "calibration": {"dataset": "self", "num_samples": 16, "seq_len": 64},
    }


def _metrics(name, ppl, inc, kl, top1, greedy):
    return {
        "name": name,
        "perplexity": ppl,
        "ppl_increase_pct": inc,
        "kl_divergence": kl,
        "top1_agreement": top1,
        "greedy_match_len": greedy,
    }


def test_accuracy_markdown_is_the_verify_rows_with_the_unquantized_kv_in_brackets():
    from trtpipe.app.deploy_report import accuracy_markdown

    ref = _metrics("unquantized", 2.6407, 0.0, 0.0, 1.0, 32.0)
    rows = [
        {"recipe": "base", "quantization": "none", "kv_cache": "none", "accuracy": {"status": "baseline"}},
        {
            "recipe": "q8",
            "quantization": "fp8",
            "kv_cache": "fp8",
            "accuracy": _verified(
                [
                    ref,
                    _metrics("quantized, KV fp8", 2.7247, 3.184, 0.02430, 0.9277, 29.5),
                    _metrics("quantized, KV unquantized", 2.6741, 1.266, 0.01010, 0.9531, None),
                ]
            ),
        },
        {
            "recipe": "q4",
            "quantization": "int4_awq",
            "kv_cache": "none",
            "accuracy": _verified(
                [ref, _metrics("quantized", 2.8339, 7.319, 0.06656, 0.8848, 12.88)], gate="FAIL: perplexity"
            ),
        },
        {
            "recipe": "new",
            "quantization": "int8_sq",
            "kv_cache": "none",
            "accuracy": {"status": "not verified yet (trtpipe build new.yaml)"},
        },
    ]
    lines = accuracy_markdown(rows).splitlines()
    assert lines[0].startswith("| recipe | quantization | KV cache | perplexity |")
    assert not any(line.startswith("| base ") for line in lines)  # the baseline is the reference, not a row
    assert lines[2] == (
        "| q8 | fp8 | fp8 | 2.7247 (2.6741) | 3.18 (1.27) | 0.0243 (0.0101) | 0.928 (0.953) | 29.5 of 32 | pass |"
    )  # no bracket where the unquantized-KV value is missing
    assert lines[3] == "| q4 | int4_awq | none | 2.8339 | 7.32 | 0.0666 | 0.885 | 12.9 of 32 | FAIL: perplexity |"
    assert lines[4].startswith("| new | int8_sq | none | not verified yet (trtpipe build new.yaml) |")
    assert "- q8: unquantized perplexity 2.6407; held-out 8x64 tokens (self), calibration 16x64 (self)" in lines[6]
