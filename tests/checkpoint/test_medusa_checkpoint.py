"""Medusa heads written into a TensorRT-LLM checkpoint with upstream's names (trtpipe/checkpoint/medusa.py): per tp
rank, split along dim 0, read back whole; the base model in it loads and runs unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trtpipe.checkpoint.convert import convert
from trtpipe.checkpoint.medusa import checkpoint_heads, write_medusa_checkpoint
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic_heads import make_medusa_heads
from trtpipe.runtime import load_checkpoint


@pytest.mark.parametrize("tp", [1, 2])
def test_heads_are_written_with_upstream_names_and_read_back(tmp_path, stories_dir, tp):
    heads = make_medusa_heads(stories_dir, tmp_path / "heads", num_heads=3, seed=2)
    base = convert(stories_dir, tmp_path / "ck", tp=tp, pp=1, dtype="float32")
    out = write_medusa_checkpoint(base, heads, tmp_path / "medusa", num_heads=3, max_draft_len=3)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["architecture"], cfg["num_medusa_heads"], cfg["num_medusa_layers"], cfg["max_draft_len"]) == (
        "MedusaForCausalLM",
        3,
        1,
        3,
    )
    src = load_file(str(heads / "medusa_lm_head.safetensors"))
    r0 = load_file(str(out / "rank0.safetensors"))
    H = src["0.0.linear.weight"].shape[0]
    assert r0["medusa_heads.2.medusa_layers.0.linear.weight"].shape == (H // tp, H)
    assert torch.equal(r0["medusa_heads.1.medusa_layers.0.linear.bias"], src["1.0.linear.bias"][: H // tp])
    t, n, layers = checkpoint_heads(out)
    assert (n, layers) == (3, 1) and set(t) == set(src)
    assert all(torch.equal(t[k], src[k]) for k in src)  # float32 checkpoint: bit for bit
    ids = torch.tensor([[1, 40, 50, 60]])
    from trtpipe.serving.reference_engine import ReferenceEngine  # noqa: F401 - the loader is what the twin uses

    a, b = load_checkpoint(base), load_checkpoint(out)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))  # the base model is untouched


def test_a_heads_directory_missing_a_tensor_leaves_nothing(tmp_path, stories_dir):
    from safetensors.torch import save_file

    heads = make_medusa_heads(stories_dir, tmp_path / "heads", num_heads=2, seed=2)
    t = load_file(str(heads / "medusa_lm_head.safetensors"))
    del t["1.1.weight"]
    save_file(t, str(heads / "medusa_lm_head.safetensors"))
    base = convert(stories_dir, tmp_path / "ck", tp=1, pp=1, dtype="float32")
    with pytest.raises(CheckpointError, match=r"tensor '1.1.weight' \(lm_head\) is missing"):
        write_medusa_checkpoint(base, heads, tmp_path / "medusa", num_heads=2, max_draft_len=2)
    assert not (tmp_path / "medusa").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_twin_drafts_with_the_heads_built_into_the_engine_checkpoint(tmp_path, stories_dir):
    """The Triton twin's tensorrt_llm model hands draft_engine its engine's checkpoint: the heads come from there
    (what trtllm-build built in), not from the recipe's heads directory."""
    from trtpipe.serving.api import ExecutorConfig
    from trtpipe.serving.reference_engine import draft_engine

    heads = make_medusa_heads(stories_dir, tmp_path / "heads", num_heads=3, seed=2)
    out = write_medusa_checkpoint(
        convert(stories_dir, tmp_path / "ck", tp=1, pp=1, dtype="float32"), heads, tmp_path / "m", 3, 3
    )
    cfg = ExecutorConfig(
        max_batch_size=2,
        max_num_tokens=64,
        max_input_len=32,
        max_seq_len=64,
        num_blocks=16,
        speculative_decoding_type="Medusa",
        max_draft_len=3,
        speculative_model=str(tmp_path / "absent"),  # not read: the checkpoint has the heads
    )
    model = load_checkpoint(out)
    got = draft_engine(cfg, model, out)
    src = load_file(str(heads / "medusa_lm_head.safetensors"))
    assert got.num_heads == 3 and torch.equal(got.lm_heads[2].weight, src["2.1.weight"])
