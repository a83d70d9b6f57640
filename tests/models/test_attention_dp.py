"""Attention data parallel in the checkpoint and the one-process runtime: every rank file holds the whole attention,
dense MLP, shared experts, embedding and lm_head and its block of routed experts (``mapping.enable_attention_dp``);
the one-process model of such a checkpoint computes what transformers' float64 DeepseekV3 does. (One process per
rank: tests/serving/mpi/test_attention_dp.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from numerics import assert_as_accurate, error_scale, hf_float64
from trtpipe.checkpoint.convert import convert
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic import load_hf, make_synthetic
from trtpipe.runtime import load_checkpoint

IDS = torch.randint(3, 250, (2, 14), generator=torch.Generator().manual_seed(4))
EXPERTS = ("mlp.fc.", "mlp.proj.")  # the routed experts' tensors (TRT-LLM names)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_synthetic("deepseek_v3", tmp_path_factory.mktemp("adp") / "hf", seed=3)


def test_rank_files_hold_whole_attention_and_their_experts(hf_dir, tmp_path):
    whole = load_file(convert(hf_dir, tmp_path / "tp1", dtype="float32") / "rank0.safetensors")
    ckpt = convert(hf_dir, tmp_path / "adp", tp=2, moe_ep=2, dtype="float32", attention_dp=True)
    assert json.loads((ckpt / "config.json").read_text())["mapping"]["enable_attention_dp"] is True
    ranks = [load_file(ckpt / f"rank{r}.safetensors") for r in range(2)]
    assert set(ranks[0]) == set(ranks[1]) == set(whole)
    experts = [k for k in whole if any(f".{e}" in k for e in EXPERTS)]
    assert experts and len(experts) < len(whole)
    for name, t in whole.items():
        if name in experts:  # [E, ...]: rank r holds experts r*E/2 ..
            half = t.shape[0] // 2
            for r in range(2):
                assert torch.equal(ranks[r][name], t[r * half : (r + 1) * half]), name
        else:
            assert torch.equal(ranks[0][name], t) and torch.equal(ranks[1][name], t), name


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k2"])
def test_one_process_attention_dp_logits_as_transformers(kind, tmp_path):
    d = make_synthetic(kind, tmp_path / kind, seed=3)
    model = load_checkpoint(convert(d, tmp_path / "ckpt", tp=2, moe_ep=2, dtype="float32", attention_dp=True))
    hf32 = load_hf(d)
    with torch.no_grad():
        ref32, ref64 = hf32(IDS).logits, hf_float64(hf32)(IDS).logits
    assert_as_accurate(model(IDS), ref64, error_scale(ref32, ref64), f"{kind} attention-DP 2 ep 2")


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(tp=1), "attention data parallel needs a mixture-of-experts model at tp > 1"),
        (dict(tp=2, use_parallel_embedding=True), "keeps the whole embedding on every rank"),
    ],
)
def test_conversion_refuses_what_attention_dp_cannot_be(hf_dir, tmp_path, kw, message):
    with pytest.raises(CheckpointError, match=message):
        convert(hf_dir, tmp_path / "ckpt", dtype="float32", attention_dp=True, **kw)
    assert not (tmp_path / "ckpt").exists()


def test_conversion_refuses_attention_dp_of_a_dense_model(stories_dir, tmp_path):
    with pytest.raises(CheckpointError, match="needs a mixture-of-experts model at tp > 1.*got 0 experts at tp=2"):
        convert(stories_dir, tmp_path / "ckpt", tp=2, dtype="float32", attention_dp=True)
