"""The llmapi target in a recipe: what TensorRT-LLM's PyTorch backend cannot load is refused at validation,
with the reason and the alternatives, before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.app.validation import check_recipe
from trtpipe.app.validation import load_recipe

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path, stories_dir: Path, body: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(
        f"name: t\nmodel:\n  source: {stories_dir}\ntriton:\n  max_batch_size: 8\nengine:\n  max_batch_size: 8\n{body}"
    )
    return p


def _problems(path: Path) -> list:
    return check_recipe(load_recipe(path, check_rules=False))


def test_int8_smoothquant_refused_for_llmapi(tmp_path, stories_dir):
    p = _recipe(tmp_path, stories_dir, "target: llmapi\nquantization:\n  algo: int8_sq\n")
    r = CliRunner().invoke(main, ["validate", str(p)])
    assert r.exit_code == 2, r.output
    line = next(l for l in r.output.splitlines() if "quantization.algo" in l)
    assert ":10:9: quantization.algo: int8_sq is refused for target llmapi" in line
    assert "no linear method" in line and "fp8" in line and "target: engine" in line


def test_int8_sq_still_valid_for_the_engine_target(tmp_path, stories_dir):
    p = _recipe(tmp_path, stories_dir, "quantization:\n  algo: int8_sq\n")
    assert not [x for x in _problems(p) if "llmapi" in x.message]


def test_int8_kv_refused_for_llmapi(tmp_path, stories_dir):
    p = _recipe(tmp_path, stories_dir, "target: llmapi\nquantization:\n  algo: fp8\n  kv_cache: int8\n")
    msgs = [x.message for x in _problems(p) if x.key == "quantization.kv_cache"]
    assert any("refused for target llmapi" in m and "kv_cache: fp8" in m for m in msgs), msgs


def test_llmapi_only_algo_refused_for_engine(tmp_path, stories_dir):
    p = _recipe(tmp_path, stories_dir, "quantization:\n  algo: fp8_pc_pt\n")
    msgs = [x.message for x in _problems(p) if x.key == "quantization.algo"]
    assert any("only for target: llmapi" in m for m in msgs), msgs


def test_compressed_tensors_needs_a_scheme(tmp_path, stories_dir):
    p = _recipe(
        tmp_path,
        stories_dir,
        "target: llmapi\nquantization:\n  algo: w4a8_awq\n  group_size: 32\n"
        "  exclude: ['*lm_head', '*mlp.proj']\nllmapi:\n  compressed_tensors: true\n",
    )
    msgs = [x.message for x in _problems(p) if x.key == "llmapi.compressed_tensors"]
    assert msgs and "w4a8_awq" in msgs[0]


@pytest.mark.parametrize("algo", ["fp8", "fp8_pc_pt", "int4_wo", "int4_awq", "w4a8_awq", "nvfp4"])
def test_loadable_algos_validate(tmp_path, stories_dir, algo):
    # on the default engine.gpu (H100), and NVFP4 on a B200: FP4 GEMMs need Blackwell's tensor cores
    gpu = "  gpu: b200-180gb\n" if algo == "nvfp4" else ""
    p = _recipe(
        tmp_path,
        stories_dir,
        f"{gpu}target: llmapi\nquantization:\n  algo: {algo}\n  group_size: 32\n  exclude: ['*lm_head', '*mlp.proj']\n",
    )
    assert _problems(p) == []


def test_example_recipe_validates():
    assert _problems(REPO / "recipes" / "stories-llmapi-fp8.yaml") == []


def test_nvfp4_needs_whole_blocks(tmp_path, stories_dir):
    p = _recipe(tmp_path, stories_dir, "  gpu: b200-180gb\ntarget: llmapi\nquantization:\n  algo: nvfp4\n")
    msgs = [x.message for x in _problems(p) if x.key == "quantization.algo"]
    assert any("mlp.proj has in_features 172" in m and "'*mlp.proj'" in m for m in msgs), msgs
