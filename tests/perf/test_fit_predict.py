"""The fit is deterministic and recovers known constants; ``predict --scenarios`` keeps rows, order and units."""

from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.perf import fit as F
from trtpipe.perf.cost import Constants
from trtpipe.perf.published import COLUMNS

BASE = {
    "source_file": "test",
    "commit_or_date": "x",
    "trtllm_version": "0.14.0",
    "backend": "engine:trtllm-bench",
    "ep": "",
    "pp": "1",
    "concurrency_or_batch": "max-load",
    "metric": "output_tok_s_total",
}


def row(model, precision, gpu, tp, isl, osl, **kw):
    r = dict(
        BASE,
        model=model,
        precision=precision,
        gpu=gpu,
        tp=str(tp),
        num_gpus=str(tp),
        isl=str(isl),
        osl=str(osl),
        value="1",
    )
    r.update(kw)
    return r


def synthetic_rows(truth: Constants) -> list[dict]:
    """Rows in the published format whose values the model itself computes with ``truth``."""
    rows = []
    for model, prec, gpu in (
        ("Llama 3.1 8B", "FP8", "H100 SXM 80GB"),
        ("Llama 3.1 70B", "FP16", "A100 SXM4 80GB"),
        ("Mixtral 8x7B", "FP8", "H100 SXM 80GB"),
    ):
        for tp in (1, 2, 4) if "70B" not in model else (4, 8):
            for isl, osl in ((128, 128), (128, 2048), (2048, 128), (2048, 2048), (5000, 500)):
                rows.append(row(model, prec, gpu, tp, isl, osl))
            rows.append(row(model, prec, gpu, tp, 128, 1, metric="ttft_ms", concurrency_or_batch="static batch=1"))
            rows.append(row(model, prec, gpu, tp, 2048, 128, concurrency_or_batch="static batch=64"))
    comp = F.compile_rows(rows, truth.other_gb)
    values = F.predict(comp, truth)
    for r, v in zip(rows, values):
        r["value"] = repr(float(v))
    return rows


TRUTH = Constants(
    bw_eff=0.7,
    kv_eff=0.8,
    gemm_eff=0.5,
    attn_eff=0.3,
    link_eff=0.5,
    seq_layer_us=0.2,
    serial=0.6,
    layer_us=40.0,
    pp_bubble=0.1,
    other_gb=3.5,
)


def test_fit_is_deterministic_and_recovers_the_generating_constants():
    rows = synthetic_rows(TRUTH)
    comp = F.compile_rows(rows, TRUTH.other_gb)
    mask = comp.ok.copy()
    assert mask.all()
    names = [n for n in F.fitted_names("engine") if n != "pp_bubble"]  # TRUTH has no PyTorch-only constants
    a = F.fit(comp, mask, names=names)
    b = F.fit(comp, mask, names=names)
    assert a == b  # no randomness anywhere
    err = F.abs_rel_errors(comp, mask, F.predict(comp, a))
    assert np.median(err) < 0.02 and err.max() < 0.10  # the model can express its own data (start is far off)
    assert F.loss(comp, mask, a) < F.loss(comp, mask, Constants()) / 100


def test_predict_rows_converts_per_gpu_units():
    total = row(
        "Llama 3.1 70B", "FP8", "H100 SXM 80GB", 4, 1024, 1024, trtllm_version="1.0", backend="pytorch:trtllm-bench"
    )
    per_gpu = dict(total, metric="output_tok_s_per_gpu")
    out = F.predict_rows([total, per_gpu], {"pytorch": TRUTH})
    assert out[1] == pytest.approx(out[0] / 4, rel=1e-12)


def test_predict_scenarios_keeps_rows_order_and_blanks_unsupported(tmp_path):
    rows = [
        row("Llama 3.1 8B", "FP8", "H100 SXM 80GB", 1, 128, 128),
        row("Some Model 3B", "FP8", "H100 SXM 80GB", 1, 128, 128),  # no config: blank
        row(
            "Llama 3.1 8B",
            "BF16",
            "H100 SXM 80GB",
            1,
            128,
            16,
            backend="engine:triton-backend-serving",
            metric="ttft_ms_mean",
            concurrency_or_batch="concurrency=2",
        ),
        row("Llama 3.1 8B", "FP8", "H100 SXM 80GB", 1, 128, 128, metric="p50_widgets"),  # unknown metric: blank
        row("Llama 3.1 8B", "FP8", "Voodoo 5 6000", 1, 128, 128),  # unknown GPU: blank
        row(
            "Llama 3.1 8B",
            "FP4",
            "B200 180GB",
            1,
            1024,
            1024,
            trtllm_version="1.2",
            backend="pytorch:trtllm-bench",
            metric="output_tok_s_per_gpu",
        ),
    ]
    src, dst = tmp_path / "in.csv", tmp_path / "out.csv"
    with open(src, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    res = CliRunner().invoke(main, ["predict", "--scenarios", str(src), "--out", str(dst)])
    assert res.exit_code == 0, res.output
    with open(dst, newline="") as f:
        out = list(csv.DictReader(f))
    assert len(out) == len(rows)
    assert [list(r)[:15] for r in out] == [COLUMNS] * len(rows)
    assert [r["isl"] + r["metric"] + r["gpu"] for r in out] == [r["isl"] + r["metric"] + r["gpu"] for r in rows]
    filled = [bool(r["predicted"]) for r in out]
    assert filled == [True, False, True, False, False, True]
    assert all(float(r["predicted"]) > 0 for r in out if r["predicted"])
    assert res.output.strip().endswith(": 3 rows predicted")
    again = CliRunner().invoke(main, ["predict", "--scenarios", str(src), "--out", str(dst)])
    assert again.exit_code != 0 and "already exists" in again.output
    assert len(list(csv.DictReader(open(dst)))) == len(rows)  # the first output is intact


def test_predict_scenarios_missing_column_is_one_line(tmp_path):
    src = tmp_path / "bad.csv"
    src.write_text("model,gpu\nx,y\n")
    res = CliRunner().invoke(main, ["predict", "--scenarios", str(src), "--out", str(tmp_path / "o.csv")])
    assert res.exit_code != 0
    assert "bad.csv: missing column(s)" in res.output
    assert not (tmp_path / "o.csv").exists()


def test_fit_all_picks_the_memory_reservation_that_made_the_data():
    truth = replace(TRUTH, other_gb=8.0)
    rows = synthetic_rows(truth)
    compiled = [F.compile_rows(rows, g) for g in (2.0, 8.0)]
    c, comp = F.fit_all(compiled, compiled[0].ok)
    assert comp.other_gb == 8.0 and c.other_gb == 8.0
