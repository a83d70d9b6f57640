"""Built-in evaluation/calibration sets (prose, code, arithmetic, chat), the recipe keys that use them, and the
per-slice numbers (one pass over the checkpoints, each slice scored as if alone)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from trtpipe.errors import AccuracyGateError, QuantizationError
from trtpipe.quant import accuracy, slices
from trtpipe.quant.data import load_tokenizer, token_batches
from trtpipe.recipe.schema import AccuracySection, CalibrationSection
from trtpipe.stages.quant import shares

STORIES = Path(__file__).resolve().parents[2] / "models" / "stories260k"


@pytest.mark.parametrize("name, make", [("prose", slices.prose_documents), ("code", slices.code_documents)])
def test_evaluation_and_calibration_parts_split_the_documents(name, make):
    docs = make()
    held_out = [k for k, _ in docs if slices._part_of(k) == "evaluation"]
    assert 0.1 < len(held_out) / len(docs) < 0.3 and len(held_out) >= 50  # about one in five
    evaluation = slices.texts(name, "evaluation", 0, None, "x")
    calibration = slices.texts(name, "calibration", 0, None, "x")
    assert evaluation + calibration != [t for _, t in docs]  # interleaved, not a prefix cut
    assert sorted(evaluation + calibration) == sorted(t for _, t in docs)
    assert evaluation == [t for k, t in docs if k in set(held_out)]


def test_code_is_python_source_and_prose_is_not():
    code = slices.texts("code", "evaluation", 0, None, "x")
    prose = slices.texts("prose", "evaluation", 0, None, "x")
    assert all(re.match(r"(async def|def|class) ", t) for t in code)
    assert not any(re.match(r"(async def|def|class) ", t) for t in prose)


def test_arithmetic_is_correct_seeded_and_split_by_seed():
    docs = slices.texts("arithmetic", "evaluation", 5, None, "x")
    first = [next(docs) for _ in range(3)]
    again = slices.texts("arithmetic", "evaluation", 5, None, "x")
    assert first == [next(again) for _ in range(3)]
    assert next(slices.texts("arithmetic", "calibration", 5, None, "x")) != first[0]
    for line in "".join(first).splitlines():
        a, op, b, eq, c = line.split()
        assert eq == "=" and {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)


def test_token_windows_of_a_builtin_set():
    tok = load_tokenizer(STORIES)
    x = token_batches("code", Path, "text", tok, 4, 64, part="evaluation")
    assert x.shape == (4, 64) and int(x[0, 0]) == tok.bos_token_id
    assert tok.decode(x[0, 1:12]).startswith(("def ", "class ", "async def "))


def test_chat_needs_a_template_and_names_the_slice():
    tok = load_tokenizer(STORIES)  # stories260k has no chat template
    with pytest.raises(QuantizationError, match=r"built-in set 'chat' \(evaluation\).*chat template"):
        token_batches("chat", Path, "text", tok, 2, 32)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    x = token_batches("chat", Path, "text", tok, 2, 32)
    assert "<|user|>What does" in tok.decode(x[0])


def test_schema_refuses_repeated_slice_names_and_mix_beside_dataset():
    with pytest.raises(ValidationError, match="slice names must be unique: code repeated"):
        AccuracySection(slices=[{"name": "code", "data": "code"}, {"name": "code", "data": "prose"}])
    with pytest.raises(ValidationError, match="set either dataset or mix"):
        CalibrationSection(dataset="data.txt", mix=[{"data": "code"}])
    assert CalibrationSection(mix=[{"data": "code", "weight": 2}, {"data": "prose"}]).mix[0].weight == 2


@pytest.mark.parametrize(
    "weights, total, want", [([1, 1], 8, [4, 4]), ([2, 1], 8, [5, 3]), ([1, 1, 1], 2, [1, 1, 1]), ([1], 5, [5])]
)
def test_shares(weights, total, want):
    assert shares(weights, total) == want


def _row(name, kl, top1, ppl_pct=0.0):
    return accuracy.Metrics(name, 1.0, ppl_pct, kl, top1, None)


def test_slice_gate_names_the_slice_and_inherits_limits():
    acc = AccuracySection(
        max_kl_divergence=0.05,
        slices=[{"name": "prose", "data": "prose"}, {"name": "code", "data": "code", "min_top1_agreement": 0.9}],
    )
    agg = [_row("unquantized", 0, 1), _row("quantized", 0.01, 0.95)]
    ok = {"prose": agg, "code": [_row("unquantized", 0, 1), _row("quantized", 0.04, 0.91)]}
    accuracy.check_recipe_gate(acc, agg, ok)
    bad_code = {**ok, "code": [_row("unquantized", 0, 1), _row("quantized", 0.04, 0.5)]}
    with pytest.raises(AccuracyGateError) as e:
        accuracy.check_recipe_gate(acc, agg, bad_code)
    assert str(e.value) == (
        "accuracy gate failed for slice 'code' (accuracy.slices[1]), quantized: "
        "top-1 agreement 0.5000 < min_top1_agreement 0.9"
    )
    bad_prose = {**ok, "prose": [_row("unquantized", 0, 1), _row("quantized", 0.06, 1.0)]}  # the inherited KL
    with pytest.raises(AccuracyGateError, match=r"slice 'prose' \(accuracy.slices\[0\]\).*KL 0.060000 > max_kl"):
        accuracy.check_recipe_gate(acc, agg, bad_prose)


def test_slice_rows_are_the_rows_of_each_slice_alone():
    """Per-sample sums: the rows of a range of samples are the rows computed on those samples alone."""
    import torch

    n, t = 6, 5
    g = torch.Generator().manual_seed(0)
    nll = {s: torch.rand(n, generator=g, dtype=torch.float64) * 10 for s in ("unquantized", "q")}
    kl = {"q": torch.rand(n, generator=g, dtype=torch.float64)}
    top1 = {"q": torch.randint(0, t + 1, (n,), generator=g).double()}
    idx = range(2, 5)
    got = accuracy._rows(["q"], nll, kl, top1, idx, t)
    alone = accuracy._rows(["q"], {s: v[2:5] for s, v in nll.items()}, {"q": kl["q"][2:5]}, {"q": top1["q"][2:5]},
                           range(3), t)  # fmt: skip
    assert got == alone
    assert math.isclose(got[1].kl_divergence, float(kl["q"][2:5].sum()) / (3 * t))
