"""The engine path's LoRA tensors (hf_lora_convert.py's math, ported): decoded back, each row is peft's own merged
delta of that module; the layout facts (row per layer and module, padding, module ids, int32 config); and the
upstream rank assumption reproduced and named.

Upstream's script itself cannot run here (it imports tensorrt_llm, which this CPU environment does not install):
the port is compared value for value with an independent re-derivation of the script's layout instead (below)."""

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


# ---- against an independent re-derivation of upstream's layout -------------------------------------------------
# Upstream's script (examples/hf_lora_convert.py@05316d33) imports tensorrt_llm, which this CPU machine does not
# install, so its output cannot be produced here. The expected tensors below are derived from the adapter's PEFT
# modules and the base's shapes, not from the port's code path: LoraManager.LORA_MODULE_IDS
# (tensorrt_llm/lora_manager.py@30e6fb55), hf_modules_to_trtllm_modules (the script), one row per (layer, module)
# in the order the adapter file lists them, the row lora_A then lora_B * scale, "assume that the hidden dim is the
# larger of the 2" (lora_A kept [r, in] unless in < r, lora_B kept [out, r] unless out < r, adapter_size min(out, r)),
# scale alpha / r or alpha / sqrt(r) with use_rslora, rows zero-padded, [1, rows, width] and [1, rows, 3] int32.

UPSTREAM_IDS = {
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
UPSTREAM_MODULES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "up_proj": "mlp_gate",
    "down_proj": "mlp_4h_to_h",
}


def _rederived(adapter_dir, base_dir, dtype):
    import json
    import math

    from safetensors import safe_open

    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    model = peft_model(base_dir, adapter_dir, torch.float32)  # the adapter's weights, read by peft
    lora = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        order = []  # (layer, module) in the file's order
        for key in f.keys():
            parts = key.split(".")
            where = (int(parts[parts.index("layers") + 1]), parts[parts.index("layers") + 3])
            if where not in order:
                order.append(where)
    rows, config = [], []
    for layer, module in order:
        m = next(m for n, m in lora.items() if f".layers.{layer}." in n and n.endswith("." + module))
        a = m.lora_A["default"].weight.detach()  # [r, in]
        b = m.lora_B["default"].weight.detach()  # [out, r]
        fan_in, out = a.shape[1], b.shape[0]
        a_stored = a.t() if fan_in < r else a
        b_stored = (b.t() if out < r else b) * scale
        rows.append(torch.cat([a_stored.flatten().to(dtype), b_stored.flatten().to(dtype)]))
        config.append([UPSTREAM_IDS[UPSTREAM_MODULES[module]], layer, min(out, r)])
    width = max(len(x) for x in rows)
    weights = torch.zeros(1, len(rows), width, dtype=dtype)
    for i, x in enumerate(rows):
        weights[0, i, : len(x)] = x
    return weights.numpy(), np.array([config], dtype=np.int32)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["r8-attn", "r64-all", "r8-all-rslora", "r64-attn-rslora"])
def test_equals_an_independent_rederivation_of_upstreams_layout(name, dtype, adapters, stories_dir):
    """Ranks 8 and 64, attention-only and all-linear, two with rsLoRA: value for value, in both storage dtypes."""
    weights, config = convert(adapters[name], dtype)
    want_w, want_c = _rederived(adapters[name], stories_dir, getattr(torch, dtype))
    assert config.dtype == np.int32 and np.array_equal(config, want_c)
    assert weights.dtype == np.dtype(dtype) and weights.shape == want_w.shape
    assert np.array_equal(weights, want_w)
    if name.startswith("r64"):  # r above k/v's out 32: upstream's transposed lora_B and adapter_size 32, kept
        assert {int(r) for m, _, r in config[0] if m in (2, 3)} == {32}
