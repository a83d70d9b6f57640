"""The lossy steps of a pre-quantized engine conversion are named and opt-in (``model.allow_lossy_import``):
``trtpipe validate`` refuses a step the source needs and the recipe does not list (FP8: decided from the fused
members' weight-scale scalars; zero points: from the model dtype), in one line naming the step, where, why and the
key; the conversion refuses it again before anything is written; the llmapi target has no lossy step. The
measurement of scripts/lossy_imports.py (committed in docs/results/lossy_imports.json) is rerun here on three of its
cases against the format's error: every requantized FP8 weight within one E4M3 rounding, the float32 control at
float32 summation order."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from prequantized import prequantized
from trtpipe.checkpoint.convert import convert
from trtpipe.errors import CheckpointError
from trtpipe.quant.imported import lossy
from trtpipe.quant.imported.detect import detect
from trtpipe.quant.imported.trtllm import ImportedLinears
from trtpipe.recipe.schema import LossyImportStep
from trtpipe.app.validation import check_recipe, load_recipe

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "docs" / "results" / "lossy_imports.json"


def _problems(tmp_path: Path, source: Path, model: str = "", target: str = "engine") -> list:
    p = tmp_path / f"{target}.yaml"
    p.write_text(f"name: t\nwork_dir: {tmp_path / 'w'}\ntarget: {target}\nmodel:\n  source: {source}\n{model}")
    return [(x.key, x.message) for x in check_recipe(load_recipe(p, check_rules=False))]


def test_the_schema_offers_exactly_the_steps_the_converter_names():
    assert set(LossyImportStep.__args__) == set(lossy.STEPS)


@pytest.mark.slow  # the producers' venv makes the fixture
@pytest.mark.parametrize("name", ["modelopt-fp8-stories", "llmc-fp8_static-stories"])
def test_fp8_members_with_different_scales_need_fp8_requantize(tmp_path, name):
    src = prequantized(name)
    found = _problems(tmp_path, src)
    assert len(found) == 1, found
    key, msg = found[0]
    assert key == "model.source"
    assert msg.startswith("model.layers.0.self_attn: q_proj/k_proj/v_proj weight scales differ (")
    assert "fusing them into TensorRT-LLM's attention.qkv requantizes to the max (one FP8 rounding)" in msg
    assert msg.endswith("; add fp8_requantize to model.allow_lossy_import to accept"), msg
    assert _problems(tmp_path, src, "  allow_lossy_import: [fp8_requantize]\n") == []
    # the step accepted is not the one needed: refused at the key the recipe wrote
    found = _problems(tmp_path, src, "  allow_lossy_import: [zero_point_rounding]\n")
    assert [k for k, _ in found] == ["model.allow_lossy_import"] and "fp8_requantize" in found[0][1]


@pytest.mark.slow  # the producers' venv makes the fixture
@pytest.mark.parametrize("name", ["llmc-w4a16_asym-stories", "gptqmodel-awq_gemm-qwen3"])
def test_zero_points_need_zero_point_rounding_except_in_float32(tmp_path, name):
    src = prequantized(name)
    ((key, msg),) = _problems(tmp_path, src)
    assert key == "model.source" and "has zero points" in msg and "model dtype bfloat16 (relative 2^-8" in msg
    assert msg.endswith("add zero_point_rounding to model.allow_lossy_import to accept"), msg
    assert _problems(tmp_path, src, "  allow_lossy_import: [zero_point_rounding]\n") == []
    assert _problems(tmp_path, src, "  dtype: float32\n") == []  # zero = -zero_point * s held exactly


@pytest.mark.slow  # the producers' venv makes the fixture
def test_exact_sources_and_the_llmapi_target_need_no_key(tmp_path, stories_dir):
    assert _problems(tmp_path, prequantized("modelopt-w4a16_awq-stories")) == []  # symmetric: exact re-layout
    fp8 = prequantized("modelopt-fp8-stories")
    assert _problems(tmp_path, fp8, target="llmapi") == []  # passed through: nothing rounded
    ((key, msg),) = _problems(tmp_path, fp8, "  allow_lossy_import: [fp8_requantize]\n", target="llmapi")
    assert key == "model.allow_lossy_import" and "no lossy step" in msg
    ((key, msg),) = _problems(tmp_path, stories_dir, "  allow_lossy_import: [fp8_requantize]\n")
    assert key == "model.allow_lossy_import" and "not quantized" in msg


@pytest.mark.slow  # the producers' venv makes the fixture
@pytest.mark.parametrize(
    "name, step",
    [("modelopt-fp8-stories", lossy.FP8_REQUANTIZE), ("llmc-w4a16_asym-stories", lossy.ZERO_POINT_ROUNDING)],
)
def test_the_conversion_refuses_an_unaccepted_step_and_writes_nothing(tmp_path, name, step):
    src = prequantized(name)
    fmt = detect(src)
    out = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=f"add {step} to model.allow_lossy_import to accept"):
        convert(src, out, dtype="bfloat16", importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src)))
    assert not out.exists() and not list(tmp_path.iterdir())


def _lossy_imports():
    spec = importlib.util.spec_from_file_location("lossy_imports", ROOT / "scripts" / "lossy_imports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# the cases of scripts/lossy_imports.py measured here (the script's others are the same steps on other fixtures)
MEASURED = [
    ("modelopt-fp8-stories", lossy.FP8_REQUANTIZE, "float32"),
    ("llmc-w4a16_asym-stories", lossy.ZERO_POINT_ROUNDING, "auto"),
    ("llmc-w4a16_asym-stories", None, "float32"),
]


@pytest.mark.slow  # the producers' venv makes the fixture
@pytest.mark.parametrize("name, step, dtype", MEASURED)
def test_the_measurement_is_within_the_formats_error(tmp_path, name, step, dtype):
    """The committed measurement's own function (scripts/lossy_imports.py ``one``), run on the code as it is:
    FP8 rows: the requantization happened and moved no weight by more than one E4M3 rounding (share <= 1), and it
    costs accuracy (KL positive); zero-point rows in a half dtype show the rounding; the float32 control is exact up
    to float32 summation order."""
    r = _lossy_imports().one(name, step, dtype, tmp_path)
    float32_sum = 64 * 2.0**-24  # float32 summation order over the model's depth (tests/numerics.py's scale)
    assert r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 1, r
    if r["step"] == lossy.FP8_REQUANTIZE:
        assert 0 < r["requantized_elements"] <= r["fused_elements"], r
        assert r["max_share_of_fp8_rounding_bound"] <= 1.0, r
        assert r["kl_mean"] > 0, r
    elif r["step"] == lossy.ZERO_POINT_ROUNDING:
        assert r["dtype"] in ("bfloat16", "float16"), r
        assert r["kl_mean"] > 0 or r["max_rel_logit_change"] > 0, r  # the rounding is visible
    else:  # the float32 control: nothing rounded
        assert r["dtype"] == "float32" and r["top1_agreement"] == 1.0, r
        assert r["max_rel_logit_change"] <= float32_sum, r


def test_the_committed_measurement_covers_every_step_and_the_roundoffs_are_the_formats():
    data = json.loads(RESULTS.read_text())
    assert data["command"] == "python scripts/lossy_imports.py"
    assert {r["step"] for r in data["results"]} >= set(lossy.STEPS)
    # the unit roundoffs the refusals and docs state are the formats' own
    assert torch.finfo(torch.float8_e4m3fn).eps / 2 == lossy.FP8_UNIT_ROUNDOFF
    assert torch.finfo(torch.bfloat16).eps / 2 == lossy.UNIT_ROUNDOFF["bfloat16"]
    assert torch.finfo(torch.float16).eps / 2 == lossy.UNIT_ROUNDOFF["float16"]
