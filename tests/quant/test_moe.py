"""FP8 on a mixture-of-experts model (synthetic Mixtral): per-expert weight scales [E_r, 1] and one activation
scale per MoE linear (contract §3.1), experts split by moe_ep / moe_tp exactly as the checkpoint splits them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from numerics import assert_same_model
from quant_helpers import our_quant, our_stats
from trtpipe.checkpoint.convert import convert
from trtpipe.models.synthetic import make_synthetic
from trtpipe.runtime import load_checkpoint

F8, F32 = torch.float8_e4m3fn, torch.float32


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    hf = make_synthetic("mixtral", root / "hf", seed=2)
    base = {
        name: convert(hf, root / name, tp=2, dtype="bfloat16", **kw)
        for name, kw in {"ep2": dict(moe_ep=2, moe_tp=1), "mtp2": dict(moe_ep=1, moe_tp=2)}.items()
    }
    base["tp1"] = convert(hf, root / "tp1", dtype="bfloat16")
    tokens = torch.randint(3, 250, (8, 32), generator=torch.Generator().manual_seed(4))
    stats = our_stats(base["ep2"], tokens, root / "stats")  # un-split from an expert-parallel checkpoint
    quant = {k: our_quant(b, base["tp1"], stats, root / f"fp8_{k}", "fp8", kv="fp8") for k, b in base.items()}
    return base, quant, tokens


@pytest.mark.parametrize("layout", ["ep2", "mtp2"])
def test_moe_fp8_layout(mixtral, layout):
    _, quant, _ = mixtral
    r = load_file(str(quant[layout] / "rank1.safetensors"))
    p = "transformer.layers.1.mlp."
    e_r, inter_r = (2, 64) if layout == "ep2" else (4, 32)  # 4 experts, intermediate 64, hidden 64
    assert (r[p + "fc.weight"].dtype, tuple(r[p + "fc.weight"].shape)) == (F8, (e_r, 2 * inter_r, 64))
    assert (r[p + "fc.weights_scaling_factor"].dtype, tuple(r[p + "fc.weights_scaling_factor"].shape)) == (
        F32,
        (e_r, 1),
    )
    assert tuple(r[p + "fc.activation_scaling_factor"].shape) == (1,)
    assert (r[p + "proj.weight"].dtype, tuple(r[p + "proj.weight"].shape)) == (F8, (e_r, 64, inter_r))
    assert r[p + "router.weight"].dtype == F32  # never quantized


def test_moe_fp8_same_model_in_every_layout(mixtral):
    base, quant, tokens = mixtral
    ref = load_checkpoint(base["tp1"])(tokens)
    one = load_checkpoint(quant["tp1"])(tokens)
    for layout in ("ep2", "mtp2"):
        assert_same_model(load_checkpoint(quant[layout]), load_checkpoint(quant["tp1"]), tokens, layout)
    logp = F.log_softmax(ref, -1)
    kl = (logp.exp() * (logp - F.log_softmax(one, -1))).sum(-1).mean().item()
    assert 0 < kl < 0.05, kl


def test_unsplit_restores_the_unsharded_experts(mixtral):
    from trtpipe.quant.writer import TrtllmSource

    base, _, _ = mixtral
    full = TrtllmSource(base["tp1"]).layer(1)
    for layout in ("ep2", "mtp2"):
        got = TrtllmSource(base[layout]).layer(1)
        assert set(got) == set(full)
        for k in full:
            assert torch.equal(got[k], full[k]), (layout, k)
