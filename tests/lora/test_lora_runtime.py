"""LoRA on the reference runtime against peft on transformers in float64 (unmerged and merged), per adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lora_adapters import ADAPTERS, make_adapter, peft_model
from numerics import assert_as_accurate, error_scale, float64_copy
from trtpipe.runtime.hf_loader import load_hf_checkpoint
from trtpipe.runtime.lora import AdapterError, LoraLinear, attach, load_adapter, whole_batch

PROMPT = [1, 403, 407, 261, 378, 299, 343, 300, 400, 31, 262, 319]


@pytest.fixture(scope="module")
def model(stories_dir):
    m = load_hf_checkpoint(stories_dir)
    return m, attach(m)


def _context(m):
    return next(mod.context for mod in m.modules() if isinstance(mod, LoraLinear))


@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_match_peft_float64(name, merged, model, adapters, layout, stories_dir):
    m, ctx = model
    adapter = load_adapter(name, adapters[name], layout)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref64 = peft_model(stories_dir, adapters[name], torch.float64, merged)(ids).logits[0]
        ref32 = peft_model(stories_dir, adapters[name], torch.float32, merged)(ids).logits[0]
    scale = error_scale(ref32, ref64)  # peft's own float32 error on this adapter: the format's error scale
    with ctx.use(whole_batch(adapter)):
        ours = m(ids)[0]
    assert_as_accurate(ours, ref64, scale, f"{name} float32 vs peft float64")
    base = m(ids)[0].double()
    assert float((base - ref64).abs().max()) > 1000 * scale, "the adapter must change the logits"


def test_mixed_batch_rows_equal_solo(model, adapters, layout):
    """Four rows in one forward, three adapters and the base: each row equals its solo run (the deltas grouped
    by adapter, gathered and added back)."""
    m, ctx = model
    names = ["r8-attn", "r64-all", None, "r8-all-rslora"]
    loaded = {n: load_adapter(n, adapters[n], layout) for n in names if n}
    ids = torch.tensor([PROMPT, PROMPT[::-1], PROMPT[2:] + PROMPT[:2], PROMPT[1:] + [5]])
    T = ids.shape[1]
    groups = [(loaded[n], torch.arange(b * T, (b + 1) * T)) for b, n in enumerate(names) if n]
    with ctx.use(groups):
        mixed = m(ids)
    m64 = float64_copy(m)
    for b, n in enumerate(names):
        with ctx.use(whole_batch(loaded.get(n))):
            solo = m(ids[b : b + 1])[0]
        with _context(m64).use(whole_batch(loaded.get(n))):
            ref = m64(ids[b : b + 1])[0]
        assert_as_accurate(mixed[b], ref, error_scale(solo, ref), f"row {b} ({n})")


def test_refusals_name_adapter_and_key(adapters, layout, tmp_path, stories_dir):
    with pytest.raises(AdapterError, match=r"adapter 'r64-all': rank r=64 is above lora.max_lora_rank 16"):
        load_adapter("r64-all", adapters["r64-all"], layout, max_rank=16)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["r8-attn"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match=r"adapter 'dora': .*adapter_config.json: key 'use_dora' is True"):
        load_adapter("dora", dora, layout)
    with pytest.raises(AdapterError, match=r"adapter 'none': .*adapter_config.json does not exist"):
        load_adapter("none", tmp_path / "missing", layout)


def test_adapter_of_another_base_is_refused(tmp_path, layout):
    """An adapter made on a model with other shapes (a synthetic Llama, hidden 64 but 96-wide MLP, 2 layers of
    4 heads) names the module and the shapes that do not fit."""
    from trtpipe.models.synthetic import make_synthetic

    other = make_synthetic("llama", tmp_path / "other")
    path = make_adapter(other, tmp_path / "other-adapter", 8, 16, ("gate_proj",), False, seed=3)
    with pytest.raises(AdapterError, match=r"adapter 'x': mlp.gate_proj of layer 0: lora_A .* do not fit the base"):
        load_adapter("x", path, layout)
