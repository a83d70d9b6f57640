"""The engine path's LoRA tensors (hf_lora_convert.py's math, ported): decoded back, each row is peft's own merged
delta of that module; the layout facts (row per layer and module, padding, module ids, int32 config); and the
upstream rank assumption reproduced and named.

Not shown here: equality with upstream's script run on the same adapter (it imports tensorrt_llm, which this
CPU environment does not install)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lora_adapters import peft_model
from trtpipe.engine.lora_convert import MODULE_IDS, convert, rank_problems, write

HF_OF_ID = {
    1: "self_attn.q_proj",
    2: "self_attn.k_proj",
    3: "self_attn.v_proj",
    4: "self_attn.o_proj",
    5: "mlp.gate_proj",
    6: "mlp.down_proj",
    7: "mlp.up_proj",
}


@pytest.mark.parametrize("name", ["r8-attn", "r8-all-rslora"])
def test_rows_decode_to_peft_merged_delta(name, adapters, stories_dir):
    weights, config = convert(adapters[name], "float32")
    assert weights.dtype == np.float32 and config.dtype == np.int32 and config.shape[2] == 3
    from trtpipe.models.synthetic import load_hf

    base = dict(load_hf(stories_dir).double().named_parameters())
    merged = dict(peft_model(stories_dir, adapters[name], torch.float64, merged=True).named_parameters())
    targets = {m for m in HF_OF_ID.values() if m.split(".")[1] in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if "all" in name:
        targets = set(HF_OF_ID.values())
    assert config.shape[1] == 5 * len(targets) and weights.shape[:2] == (1, config.shape[1])
    for row, (module_id, layer, r) in zip(weights[0], config[0]):
        key = f"model.layers.{layer}.{HF_OF_ID[int(module_id)]}.weight"
        out_dim, in_dim = merged[key].shape
        assert r == 8
        a = torch.from_numpy(row[: r * in_dim].copy()).double().view(r, in_dim)
        b = torch.from_numpy(row[r * in_dim : r * in_dim + out_dim * r].copy()).double().view(out_dim, r)
        assert not row[r * in_dim + out_dim * r :].any()  # zero padding to the longest row
        delta = merged[key].detach() - base[key].detach()
        assert torch.allclose(b @ a, delta, rtol=0, atol=1e-6 * float(delta.abs().max())), key


def test_float16_storage_is_the_float32_rows_rounded(adapters, tmp_path):
    w32, c32 = convert(adapters["r8-attn"], "float32")
    out = write(adapters["r8-attn"], tmp_path, "float16")
    w16, c16 = np.load(out / "model.lora_weights.npy"), np.load(out / "model.lora_config.npy")
    assert w16.dtype == np.float16 and np.array_equal(w16, w32.astype(np.float16)) and np.array_equal(c16, c32)


def test_upstream_rank_assumption_reproduced_and_named(adapters):
    """r64 on stories260k (hidden 64, KV 32): upstream takes the smaller dimension for the rank, so k_proj / v_proj
    (out 32) are written with adapter_size 32; rank_problems names every module with a size below r."""
    _, config = convert(adapters["r64-all"], "float32")
    sizes = {(int(m), int(layer)): int(r) for m, layer, r in config[0]}
    assert sizes[(MODULE_IDS["attn_k"], 0)] == 32 and sizes[(MODULE_IDS["attn_q"], 0)] == 64
    problems = rank_problems(adapters["r64-all"])
    assert any("k_proj: r=64 is above one of its sizes (in 64, out 32)" in p for p in problems)
    assert not any("q_proj" in p or "down_proj" in p for p in problems)  # r = 64 = a size: written right
    assert rank_problems(adapters["r8-attn"]) == []
