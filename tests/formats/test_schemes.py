"""Every row of the scheme table through the rules and tools that read it: ``trtpipe validate`` (calibration data,
targets, tensor cores, group sizes, MoE experts), the quantize stage's data need, the planner, the predictor and the
writers. A row whose column a reader ignores fails here, as NVFP4's "needs calibration" did (an llmapi NVFP4 recipe
with a missing dataset passed validate and failed at the calibrate stage)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.formats.gpus import CATALOG
from trtpipe.formats.schemes import BY_RECIPE, GROUP_SIZES, KV_BY_RECIPE, SCHEMES, TENSOR_CORES, written_for

ROWS = list(BY_RECIPE.values())
IDS = [s.recipe for s in ROWS]
MIXTRAL = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "mixtral-8x7b"
DATASET = "quantization.calibration.dataset"
LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def _gpu(at_least: int = 0, below: int = 10_000) -> str:
    return next(g.key for g in CATALOG if at_least <= g.sm < below)


def _validate(tmp_path: Path, algo: str, target: str, gpu: str, extra: str = "", model: Path = None) -> list[str]:
    """The problem lines of `trtpipe validate` for a recipe quantized with ``algo`` (its dataset file missing)."""
    if model is None:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(LLAMA))
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: t\ntarget: {target}\nmodel:\n  source: {model}\nengine:\n  gpu: {gpu}\n"
        f"quantization:\n  algo: {algo}\n  calibration:\n    dataset: missing.jsonl\n{extra}"
        "accuracy:\n  enabled: false\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(main, ["validate", str(path)], catch_exceptions=False)
    return result.stderr.splitlines()


def _keyed(lines: list[str], key: str) -> list[str]:
    return [ln for ln in lines if f": {key}: " in ln]


def _target(s) -> str:
    return "llmapi" if "llmapi" in s.targets else "engine"


@pytest.mark.parametrize("s", ROWS, ids=IDS)
def test_needs_calibration_column_decides_the_data_rule(s, tmp_path):
    """A scheme that needs calibration data refuses a missing dataset at validate, in one line naming the key; one
    that does not never asks for it."""
    lines = _validate(tmp_path, s.recipe, _target(s), _gpu(at_least=s.min_sm))
    found = _keyed(lines, DATASET)
    if s.needs_data:
        assert len(found) == 1 and "not found:" in found[0], (s.recipe, lines)
    else:
        assert not found, (s.recipe, lines)


@pytest.mark.parametrize("s", ROWS, ids=IDS)
def test_needs_calibration_column_decides_the_quantize_stage(s, tmp_path):
    """The quantize stage calibrates exactly the schemes validate checks data for (the same column)."""
    from trtpipe.stages.quant import needs_calibration
    from trtpipe.app.validation import load_recipe

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    path = tmp_path / "r.yaml"
    path.write_text(f"name: t\ntarget: {_target(s)}\nmodel:\n  source: {model}\nquantization:\n  algo: {s.recipe}\n")
    assert needs_calibration(load_recipe(path, check_rules=False)) is s.needs_data


@pytest.mark.parametrize("target", ["engine", "llmapi"])
@pytest.mark.parametrize("s", ROWS, ids=IDS)
def test_targets_column_decides_which_target_takes_it(s, target, tmp_path):
    lines = _validate(tmp_path, s.recipe, target, _gpu(at_least=s.min_sm))
    refused = [
        ln
        for ln in _keyed(lines, "quantization.algo")
        if f"target: {target}" in ln or f"target {target}" in ln or "only for target" in ln
    ]
    assert bool(refused) is (target not in s.targets), (s.recipe, target, lines)


@pytest.mark.parametrize("s", [s for s in ROWS if s.tensor_cores], ids=lambda s: s.recipe)
def test_tensor_cores_column_decides_the_gpu_floor(s, tmp_path):
    below = _validate(tmp_path, s.recipe, _target(s), _gpu(below=s.min_sm))
    tc = TENSOR_CORES[s.tensor_cores]
    assert any(
        f"needs {tc.name} tensor cores (SM >= {tc.min_sm // 10}.{tc.min_sm % 10}" in ln
        for ln in _keyed(below, "quantization.algo")
    ), below
    at = _validate(tmp_path, s.recipe, _target(s), _gpu(at_least=s.min_sm))
    assert not any("tensor cores" in ln for ln in at), at


@pytest.mark.parametrize("s", [s for s in ROWS if "engine" in s.targets and s.groupwise], ids=lambda s: s.recipe)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_group_sizes_column_decides_the_engine_group_size(s, g, tmp_path):
    lines = _validate(
        tmp_path, s.recipe, "engine", _gpu(at_least=max(s.min_sm, 89), below=100), extra=f"  group_size: {g}\n"
    )
    refused = [ln for ln in _keyed(lines, "quantization.group_size") if "runs group_size" in ln]
    assert bool(refused) is (g not in s.group_sizes_for("engine")), (s.recipe, g, lines)


@pytest.mark.parametrize("s,target", [(s, t) for s in ROWS for t in s.targets], ids=lambda v: getattr(v, "recipe", v))
def test_moe_column_decides_the_experts(s, target, tmp_path):
    lines = _validate(
        tmp_path, s.recipe, target, _gpu(at_least=max(s.min_sm, 89)), model=MIXTRAL, extra="  group_size: 128\n"
    )
    refused = [ln for ln in _keyed(lines, "quantization.algo") if "mixture-of-experts" in ln]
    assert bool(refused) is (target not in s.moe), (s.recipe, target, lines)


def test_needs_data_column_agrees_with_the_engine_layouts():
    """A scheme the TRT-LLM checkpoint writer lays out needs calibration data exactly when its layout has static
    activation scales or a searched pre-quant scale (SmoothQuant, AWQ)."""
    from trtpipe.checkpoint.quant_layouts import ALGOS

    for name, a in ALGOS.items():
        assert BY_RECIPE[name].needs_data is (a.act_fmt is not None or a.prequant in ("smooth", "awq")), name


def test_formats_sit_at_the_bottom():
    """trtpipe.formats imports only the standard library, torch, numpy, trtpipe.errors and trtpipe.jsonfile."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "import_graph_for_formats", root / "tests" / "tools" / "import_graph.py"
    )
    import_graph = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = import_graph  # dataclasses look their module up by name
    spec.loader.exec_module(import_graph)
    graph = import_graph.build(root)
    allowed = ("trtpipe.formats", "trtpipe.errors", "trtpipe.jsonfile")
    up = [
        f"{e.path}:{e.line} {e.src} -> {e.dst}"
        for e in graph.edges
        if e.src.startswith("trtpipe.formats") and not e.dst.startswith(allowed) and e.dst != "trtpipe"
    ]
    assert not up, up
    assert any(e.src == "trtpipe.formats.dequant" and e.dst == "trtpipe.errors" for e in graph.edges)


def test_writers_are_the_tables_rows():
    """The unified-HF export, the TRT-LLM checkpoint writer and the compressed-tensors writer write the rows that
    name them, no more and no less."""
    from trtpipe.checkpoint.quant_layouts import ALGOS
    from trtpipe.export.compressed import SCHEMES as CT
    from trtpipe.export.formats import HF_FORMATS

    assert set(HF_FORMATS) == set(written_for("llmapi"))
    assert set(ALGOS) == set(written_for("engine"))
    assert set(CT) == {s.recipe for s in ROWS if s.compressed}


@pytest.mark.parametrize("s", SCHEMES, ids=[s.recipe or s.quant_algo for s in SCHEMES])
def test_planner_weighs_each_row(s):
    """The planner's bytes per weight (codes, plus 16-bit scales per group for group-wise rows) for every
    quant_algo of the table."""
    from trtpipe.engine.planner import linear_weight_bytes

    per_group = 2 / 64 if s.groupwise else 0
    assert linear_weight_bytes(s.quant_algo, 1000, 2, 64) == pytest.approx(1000 * (s.weight_bytes + per_group))


@pytest.mark.parametrize("s", [s for s in ROWS if s.perf], ids=lambda s: s.recipe)
def test_predictor_models_each_row(s):
    """Every recipe scheme has a performance-model precision whose GEMM peak the catalog's GPUs record."""
    from trtpipe.perf.cost import PRECISIONS
    from trtpipe.app.predictor import precision_of

    assert precision_of(s.recipe, "bfloat16") == s.perf
    assert PRECISIONS[s.perf].peak == s.peak
    assert PRECISIONS[s.perf].weight_bytes >= s.weight_bytes
    assert any(getattr(g, s.peak) for g in CATALOG)


@pytest.mark.parametrize("target", ["engine", "llmapi"])
@pytest.mark.parametrize("kv", list(KV_BY_RECIPE.values()), ids=list(KV_BY_RECIPE))
def test_kv_rows_through_the_rules(kv, target, tmp_path):
    """A quantized KV cache calibrates (its dataset is checked) and the llmapi target takes it exactly when the KV
    row says TensorRT-LLM's PyTorch backend loads it."""
    lines = _validate(tmp_path, "none", target, _gpu(at_least=89, below=100), extra=f"  kv_cache: {kv.recipe}\n")
    assert len(_keyed(lines, DATASET)) == 1, lines
    refused = [ln for ln in _keyed(lines, "quantization.kv_cache") if "target llmapi" in ln]
    assert bool(refused) is (target == "llmapi" and not kv.llmapi), lines


def test_recipe_enum_is_the_table():
    from typing import get_args

    from trtpipe.recipe.schema import KVCacheQuant, QuantAlgoName

    assert get_args(QuantAlgoName) == ("none", *IDS)
    assert get_args(KVCacheQuant) == ("none", "fp8", "int8")
