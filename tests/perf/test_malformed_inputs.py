"""Malformed input files give one line naming the file, the row (or key) and the field, a non-zero exit, and
nothing written: the scenarios CSV of ``predict``, a ``--model-config`` of ``plan``, a result of ``bench show``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.perf.published import COLUMNS

REPO = Path(__file__).resolve().parents[2]
GOOD = [
    "test",
    "x",
    "0.14.0",
    "engine:trtllm-bench",
    "Llama 3.1 8B",
    "FP8",
    "H100 SXM 80GB",
    "1",
    "1",
    "1",
    "",
    "128",
    "128",
    "output_tok_s_total",
    "max-load",
]
assert len(GOOD) == len(COLUMNS)


def run(*args: str):
    res = CliRunner().invoke(main, list(args))
    return res.exit_code, res.stderr, res.stdout


@pytest.mark.parametrize(
    "bad_row,line",
    [
        (GOOD[:9], "row 2: field 'pp' is missing (the row ends early)"),  # a row cut short
        (GOOD + ["extra"], "row 2: 16 fields, the header has 15"),
        (GOOD[:8] + ["two"] + GOOD[9:], "row 2: field 'tp': expected a whole number, got 'two'"),
    ],
)
def test_scenarios_csv_row_errors_name_file_row_and_field(tmp_path, bad_row, line):
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    src.write_text("\n".join(",".join(r) for r in (COLUMNS, GOOD, bad_row)) + "\n")
    code, err, out = run("predict", "--scenarios", str(src), "--out", str(dst))
    assert (code, err, out) == (1, f"{src}:3: {line}\n", "")
    assert not dst.exists() and not (tmp_path / "out.csv.tmp").exists()


def test_model_config_with_a_wrong_type_names_the_key(tmp_path):
    cfg = json.loads((REPO / "recipes" / "configs" / "llama-3.1-70b" / "config.json").read_text())
    cfg["hidden_size"] = "big"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, err, _ = run("plan", str(REPO / "recipes" / "llama70b-fp8.yaml"), "--model-config", str(path))
    assert (code, err) == (1, f"{path}: key 'hidden_size': expected a whole number, got 'big'\n")


@pytest.mark.parametrize(
    "doc,why",
    [
        ([1, 2], "not a trtpipe bench result (format 'a JSON list', expected trtpipe-bench/1)"),
        ({"format": "trtpipe-bench/1", "run": {}}, "bench result without 'metrics' (truncated or edited?)"),
    ],
)
def test_bench_show_of_a_malformed_result_is_one_line(tmp_path, doc, why):
    path = tmp_path / "result.json"
    path.write_text(json.dumps(doc))
    code, err, out = run("bench", "show", str(path))
    assert (code, err, out) == (1, f"{path}: {why}\n", "")
