"""Calibration: data loading, observers against a direct computation, spilling, the stats artifact."""

from __future__ import annotations

import json

import pytest
import torch

from numerics import assert_as_accurate, error_scale, float64_copy

from trtpipe.errors import QuantizationError
from trtpipe.quant.calibrate import ActivationBuffer, CalibSettings, calibrate, load_layer_stats, save_layer_stats
from trtpipe.quant.data import read_texts, token_windows
from trtpipe.quant.writer import TrtllmSource
from trtpipe.runtime import load_checkpoint
from trtpipe.runtime.model import rms_norm


def test_read_texts_formats(tmp_path):
    (tmp_path / "a.txt").write_text("one story")
    (tmp_path / "b.jsonl").write_text('{"body": "two"}\n\n{"body": "three"}\n')
    (tmp_path / "c.json").write_text(json.dumps([{"body": "four"}, "five"]))
    (tmp_path / "ignored.csv").write_text("x")
    assert read_texts(tmp_path / "b.jsonl", "body") == ["two", "three"]
    assert read_texts(tmp_path, "body") == ["one story", "two", "three", "four", "five"]


def test_read_texts_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(QuantizationError, match=r"bad.jsonl:2: invalid JSON"):
        read_texts(bad)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"content": "x"}\n')
    with pytest.raises(QuantizationError, match=r"wrong.jsonl: record 0 has no string field 'text'"):
        read_texts(wrong)
    with pytest.raises(QuantizationError, match="unsupported file type"):
        (tmp_path / "x.csv").write_text("a")
        read_texts(tmp_path / "x.csv")


def test_token_windows_use_the_models_tokenizer(stories_tokenizer):
    t = token_windows(["Once upon a time there was a girl."] * 20, stories_tokenizer, 4, 16, "mem")
    assert t.shape == (4, 16) and t[0, 0] == stories_tokenizer.bos_token_id
    assert stories_tokenizer.decode(t[0, 1:6]).startswith("Once upon a time")
    with pytest.raises(QuantizationError, match="less than one sample of seq_len=4096"):
        token_windows(["short"], stories_tokenizer, 4, 4096, "mem")


@pytest.mark.slow
def test_observed_amax_matches_a_direct_forward(stories_ckpts, stories_tokens):
    """Layer 0's qkv input amax equals max|rmsnorm(embedding)| computed without any calibration code; later
    layers see what the full reference model computes (the activations are passed on correctly)."""
    tokens = stories_tokens["calib"][:4]
    src = TrtllmSource(stories_ckpts[2])  # un-split from tp=2 files
    stats = calibrate(src, tokens, CalibSettings(batch_size=3))
    model = load_checkpoint(stories_ckpts[1])
    ref_model = float64_copy(model)  # the float64 truth; the direct float32 forward sets float32's error scale

    def qkv_input_amax(m, upto):
        x = m.embed(tokens)
        for layer in m.layers[:upto]:
            x = layer(x)
        return rms_norm(x, m.layers[upto].input_ln, m.args.norm_epsilon).abs().amax(dim=(0, 1))

    for i in (0, 3):
        direct, ref = qkv_input_amax(model, i), qkv_input_amax(ref_model, i)
        assert_as_accurate(stats[i].groups["attention.qkv"].amax, ref, error_scale(direct, ref), f"layer {i} amax")
    assert stats[0].k_amax.item() > 0 and stats[0].v_amax.item() > 0


@pytest.mark.slow
def test_spilled_buffer_gives_the_same_statistics(stories_ckpts, stories_tokens, tmp_path):
    tokens = stories_tokens["calib"][:4]
    src = TrtllmSource(stories_ckpts[1])
    ram = calibrate(src, tokens, CalibSettings(batch_size=2))
    buf = ActivationBuffer((4, 64, 64), spill_bytes=1, spill_dir=tmp_path)
    assert buf.spilled and any(tmp_path.iterdir())
    buf.close()
    spilled = calibrate(src, tokens, CalibSettings(batch_size=2, spill_bytes=1), spill_dir=tmp_path)
    for a, b in zip(ram, spilled):
        assert torch.equal(a.groups["mlp.proj"].amax, b.groups["mlp.proj"].amax)
    assert not any(tmp_path.iterdir())  # spill files are removed


def test_stats_roundtrip_and_missing_layer(stories_ckpts, stories_tokens, tmp_path):
    st = calibrate(TrtllmSource(stories_ckpts[1]), stories_tokens["calib"][:2], CalibSettings(awq_group_size=32))
    save_layer_stats(tmp_path, 0, st[0])
    back = load_layer_stats(tmp_path, 0)
    assert torch.equal(back.groups["mlp.fc+gate"].awq_pqs, st[0].groups["mlp.fc+gate"].awq_pqs)
    assert set(back.groups["mlp.fc+gate"].awq_amax) == {"mlp.fc", "mlp.gate"}
    assert back.groups["mlp.proj"].awq_pqs is None  # 172 inputs: no int4 groups, no search
    with pytest.raises(QuantizationError, match="layer1.safetensors: calibration statistics for layer 1"):
        load_layer_stats(tmp_path, 1)


def test_quantize_errors_name_the_linear_and_the_fix(stories_ckpts, stories_tokens, tmp_path):
    from quant_helpers import our_quant, our_stats

    base = stories_ckpts[1]
    stats = our_stats(base, stories_tokens["calib"][:2], tmp_path / "st", awq_group_size=32)
    with pytest.raises(
        QuantizationError,
        match=r"mlp.proj: in_features 172 is not a multiple of group_size 32 "
        r"\(add '\*mlp.proj' to quantization.exclude",
    ):
        our_quant(base, base, stats, tmp_path / "a", "int4_wo", group_size=32)
    with pytest.raises(
        QuantizationError, match="collected for another group size .* re-run calibration for group_size 64"
    ):
        our_quant(base, base, stats, tmp_path / "b", "int4_awq", group_size=64, exclude=("*lm_head", "*mlp.proj"))
