"""`self` calibration / evaluation data needs the whole float32 model on the host: `trtpipe validate` refuses it
up front, in one line naming the key, the size and the fix, for a model that does not fit (Llama-3.1-70B's
published config.json, 262.8 GiB in float32); models that fit, or stages that do not run, are not touched."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from trtpipe.cli import main

L70B = Path(__file__).parents[2] / "recipes" / "configs" / "llama-3.1-70b"
SIZE = "262.8 GiB"


def _validate(tmp_path: Path, source: Path, body: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: t\nwork_dir: w\nmodel:\n  source: {source}\n  dtype: bfloat16\nparallel:\n  tp: 4\n{body}")
    r = CliRunner().invoke(main, ["validate", str(path)])
    return r.exit_code, r.stderr.splitlines()


@pytest.fixture(autouse=True)
def _host_is_smaller_than_70b():
    if psutil.virtual_memory().available >= 2 * 262.8 * (1 << 30):
        pytest.skip("this host could hold Llama-70B in float32: 'self' is allowed here")


def _line(key: str) -> str:
    return (
        rf".*recipe\.yaml:\d+:\d+: {re.escape(key)}: 'self' samples text from the whole model, and the whole "
        rf"model in float32 \({SIZE}\) does not fit in host memory \([\d.]+ GiB available; at most 50% of it is "
        rf"used for a whole model\); name a \.txt, \.jsonl or \.json dataset instead"
    )


def test_self_data_refused_for_a_model_that_does_not_fit(tmp_path):
    code, err = _validate(tmp_path, L70B, "quantization:\n  algo: fp8\n  kv_cache: fp8\n")  # both default to self
    assert code == 2
    assert len(err) == 2  # (unwritten keys sit at the recipe's start: any order)
    for key in ("quantization.calibration.dataset", "accuracy.eval_data"):
        assert sum(bool(re.fullmatch(_line(key), ln)) for ln in err) == 1, err


def test_only_the_stages_that_run_are_checked(tmp_path):
    data = Path(__file__).parents[2] / "recipes" / "data"
    # int8_wo is data-free and has no KV quantization: no calibration, but verify still evaluates on 'self'
    code, err = _validate(tmp_path, L70B, "quantization:\n  algo: int8_wo\n")
    assert code == 2 and len(err) == 1 and re.fullmatch(_line("accuracy.eval_data"), err[0]), err
    code, err = _validate(tmp_path, L70B, "quantization:\n  algo: int8_wo\naccuracy:\n  enabled: false\n")
    assert (code, err) == (0, [])
    code, err = _validate(
        tmp_path,
        L70B,
        f"quantization:\n  algo: fp8\n  calibration:\n    dataset: "
        f"{data}/calibration-sample.jsonl\n"
        f"accuracy:\n  eval_data: {data}/eval-sample.jsonl\n",
    )
    assert (code, err) == (0, [])
    code, err = _validate(tmp_path, L70B, "")  # unquantized: neither stage runs
    assert (code, err) == (0, [])


def test_self_data_allowed_for_a_model_that_fits(tmp_path, stories_dir):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: t\nwork_dir: w\nmodel:\n  source: {stories_dir}\nquantization:\n  algo: fp8\n  kv_cache: fp8\n"
    )
    r = CliRunner().invoke(main, ["validate", str(path)])
    assert r.exit_code == 0, r.stderr
