"""Layer-by-layer accuracy (``accuracy.evaluate``) gives the whole-model numbers (``accuracy.compare``) on
stories260k, for every layout it reads (tp=2, pp=2) and every stream (KV quantized and not), spilled or not."""

from __future__ import annotations

import json
import math

import pytest

from quant_helpers import our_quant, our_stats
from trtpipe.quant import accuracy
from trtpipe.quant.hostmem import FIT_FRACTION, whole_model_misfit
from trtpipe.runtime import load_checkpoint

pytestmark = pytest.mark.slow

GROUP = 32
# ppl, KL and top-1 agree to 1e-5 relative. ppl +% is 100 x (ratio - 1): the ratios agree to ~1e-7, which
# is ~1e-5 percentage points after the subtraction, so it is compared absolutely.
REL, PCT_ABS = 1e-5, 1e-4


@pytest.fixture(scope="module")
def stats(stories_ckpts, stories_tokens, tmp_path_factory):
    return our_stats(stories_ckpts[1], stories_tokens["calib"], tmp_path_factory.mktemp("stats"), awq_group_size=GROUP)


def _whole_model(base, quant, tokens, batch):
    kv = (load_checkpoint(quant).config.get("quantization") or {}).get("kv_cache_quant_algo")
    names = accuracy.stream_names(kv)
    models = {names[0]: load_checkpoint(quant)}
    if kv:
        models[names[1]] = accuracy.drop_kv_quant(load_checkpoint(quant))
    return accuracy.compare(load_checkpoint(base), models, tokens, batch=batch)


def _assert_same(got, want):
    assert [r.name for r in got] == [r.name for r in want]
    for g, w in zip(got, want):
        assert math.isclose(g.perplexity, w.perplexity, rel_tol=REL), (g, w)
        assert math.isclose(g.kl_divergence, w.kl_divergence, rel_tol=REL, abs_tol=1e-12), (g, w)
        assert math.isclose(g.top1_agreement, w.top1_agreement, rel_tol=REL), (g, w)
        assert abs(g.ppl_increase_pct - w.ppl_increase_pct) < PCT_ABS, (g, w)


@pytest.mark.parametrize(
    "algo, kv, tp, exclude",
    [
        ("fp8", "fp8", 2, ("*lm_head",)),
        ("int8_sq", "none", 1, ("*lm_head",)),
        ("int4_awq", "none", 1, ("*lm_head", "*mlp.proj")),  # 172 input features have no whole groups of 32
        ("int8_sq", "int8", 2, ("*lm_head",)),
    ],
)
def test_layerwise_equals_whole_model(stories_ckpts, stories_tokens, stats, tmp_path, algo, kv, tp, exclude):
    base = stories_ckpts[tp]
    quant = our_quant(base, stories_ckpts[1], stats, tmp_path / algo, algo, kv=kv, group_size=GROUP, exclude=exclude)
    tokens = stories_tokens["heldout"]
    want = _whole_model(base, quant, tokens, batch=3)  # a batch that does not divide the 8 samples
    got, skipped = accuracy.evaluate(base, quant, tokens, batch=3)
    assert skipped is None  # stories260k fits: the greedy match is measured, and equal
    _assert_same(got, want)
    assert [g.greedy_match_len for g in got] == [w.greedy_match_len for w in want]
    assert len(got) == (3 if kv != "none" else 2) and got[1].kl_divergence > 0


def test_spilled_buffers_and_pipeline_parallel(stories_dir, stories_ckpts, stories_tokens, stats, tmp_path):
    """pp=2 rank files (layers under local indices) and memory-mapped hidden states give the same numbers."""
    from trtpipe.checkpoint.convert import convert

    base = convert(stories_dir, tmp_path / "pp2", tp=1, pp=2, dtype="bfloat16")
    quant = our_quant(base, stories_ckpts[1], stats, tmp_path / "fp8", "fp8", kv="fp8")
    tokens = stories_tokens["heldout"][:4]
    want = _whole_model(base, quant, tokens, batch=2)
    got = accuracy.teacher_forced(base, quant, tokens, batch=2, spill_bytes=0, spill_dir=tmp_path)
    _assert_same(got, want)
    assert all(r.greedy_match_len is None for r in got)
    assert not list(tmp_path.glob("trtpipe-act-*"))  # spill files are removed


def test_greedy_skip_is_reported_not_invented(tmp_path):
    gib = 1 << 30
    assert whole_model_misfit(int(FIT_FRACTION * 10 * gib), available=10 * gib) is None
    why = whole_model_misfit(280 * gib, available=20 * gib)
    assert why == (
        "the whole model in float32 (280.0 GiB) does not fit in host memory "
        "(20.0 GiB available; at most 50% of it is used for a whole model)"
    )
    rows = [
        accuracy.Metrics("unquantized", 3.0, 0.0, 0.0, 1.0, None),
        accuracy.Metrics("quantized", 3.1, 3.333, 0.01, 0.95, None),
    ]
    accuracy.write_report(tmp_path, rows, {"quant_algo": "FP8"}, why)
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert report["greedy_skipped"] == why and [r["greedy_match_len"] for r in report["rows"]] == [None, None]
    text = (tmp_path / "accuracy.txt").read_text().splitlines()
    assert text[2].split()[-1] == "skipped" and text[-1] == f"greedy match skipped: {why}"


def test_checkpoints_of_different_models_are_refused(stories_ckpts, stories_tokens, tmp_path):
    import torch

    from trtpipe.checkpoint.convert import convert
    from trtpipe.errors import QuantizationError
    from trtpipe.models.synthetic import make_synthetic

    other = convert(make_synthetic("llama", tmp_path / "hf", dtype=torch.bfloat16), tmp_path / "ck", dtype="bfloat16")
    with pytest.raises(
        QuantizationError, match=r"/ck/config.json: num_layers 2 differs from 5 in .* \(not a quantization"
    ):
        accuracy.teacher_forced(stories_ckpts[1], other, stories_tokens["heldout"][:1])
