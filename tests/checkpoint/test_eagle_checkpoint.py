"""EAGLE-1/2 heads written into a TensorRT-LLM checkpoint with upstream's names (trtpipe/checkpoint/eagle.py): one
EagleNet copy per eagle layer, each with the base model's lm_head, split over tp and read back whole; the base model
in it loads and runs unchanged, and the twin drafts from the head built into it as from the head's directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trtpipe.checkpoint.convert import convert
from trtpipe.checkpoint.eagle import checkpoint_head, write_eagle_checkpoint
from trtpipe.errors import CheckpointError
from trtpipe.models.synthetic_heads import make_eagle1_head
from trtpipe.runtime import load_checkpoint


@pytest.mark.parametrize("tp", [1, 2])
def test_the_head_is_written_with_upstream_names_and_read_back(tmp_path, stories_dir, tp):
    head = make_eagle1_head(stories_dir, tmp_path / "head", num_layers=2, seed=2)
    base = convert(stories_dir, tmp_path / "ck", tp=tp, pp=1, dtype="float32")
    out = write_eagle_checkpoint(base, head, tmp_path / "eagle", 3, 3, 1)
    cfg = json.loads((out / "config.json").read_text())
    keys = ("architecture", "num_eagle_layers", "max_draft_len", "max_non_leaves_per_layer")
    assert tuple(cfg[k] for k in keys) == ("EagleForCausalLM", 3, 3, 1)
    net = cfg["eagle_net_config"]
    assert (net["architecture"], net["num_hidden_layers"], net["mapping"]["tp_size"]) == ("LlamaForCausalLM", 2, tp)
    src = torch.load(head / "pytorch_model.bin", weights_only=True)
    H = src["fc.weight"].shape[0]
    for r in range(tp):
        shard, base_shard = load_file(str(out / f"rank{r}.safetensors")), load_file(str(base / f"rank{r}.safetensors"))
        for e in range(3):  # each EagleNet a full copy, its lm_head the base model's (load_eagle_hf)
            p = f"eagle_nets.{e}."
            assert torch.equal(shard[p + "lm_head.weight"], base_shard["lm_head.weight"])
            assert shard[p + "drafter.fc.weight"].shape == (H // tp, 2 * H)
            assert torch.equal(shard[p + "drafter.fc.bias"], src["fc.bias"].chunk(tp)[r])
            assert torch.equal(shard[p + "drafter.vocab_embedding.weight"], src["embed_tokens.weight"])
            assert p + "drafter.layers.0.input_layernorm.weight" not in shard  # layer 0 has none
            assert p + "drafter.layers.1.input_layernorm.weight" in shard
            for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
                assert p + f"drafter.layers.0.{name}.weight" in shard
    layers, (fc_w, fc_b), emb, hf = checkpoint_head(out)
    assert torch.equal(fc_w, src["fc.weight"]) and torch.equal(fc_b, src["fc.bias"])  # float32: bit for bit
    q, k, v = (src[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(layers[1]["attention.qkv.weight"], torch.cat([q, k, v]))
    assert torch.equal(layers[0]["mlp.proj.weight"], src["layers.0.mlp.down_proj.weight"])
    assert torch.equal(layers[1]["input_layernorm.weight"], src["layers.1.input_layernorm.weight"])
    assert hf["num_hidden_layers"] == 2 and hf["hidden_size"] == H
    ids = torch.tensor([[1, 40, 50, 60]])
    a, b = load_checkpoint(base), load_checkpoint(out)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))  # the base model is untouched


def test_the_twin_drafts_the_same_from_the_built_checkpoint_as_from_the_head(tmp_path, stories_dir):
    from trtpipe.serving.eagle1 import load_eagle1_head

    head = make_eagle1_head(stories_dir, tmp_path / "head", seed=3)
    base = convert(stories_dir, tmp_path / "ck", tp=2, pp=1, dtype="float32")
    out = write_eagle_checkpoint(base, head, tmp_path / "eagle", 2, 2, 1)
    target = load_checkpoint(out)
    a, b = load_eagle1_head(head, target), load_eagle1_head(out, target)
    x = torch.randn(1, 5, target.args.hidden_size)
    for la, lb in zip(a.layers, b.layers):
        for (na, pa), (nb, pb) in zip(la.named_parameters(), lb.named_parameters()):
            assert na == nb and torch.equal(pa, pb)
    assert torch.equal(a.fc(torch.cat([x, x], -1)), b.fc(torch.cat([x, x], -1)))
    assert torch.equal(a.model.embedding, b.model.embedding)


def test_a_head_missing_fc_leaves_nothing(tmp_path, stories_dir):
    head = make_eagle1_head(stories_dir, tmp_path / "head", seed=2)
    t = torch.load(head / "pytorch_model.bin", weights_only=True)
    del t["fc.bias"]
    torch.save(t, head / "pytorch_model.bin")
    base = convert(stories_dir, tmp_path / "ck", tp=1, pp=1, dtype="float32")
    with pytest.raises(CheckpointError, match="EAGLE head tensor 'fc.bias' is missing"):
        write_eagle_checkpoint(base, head, tmp_path / "eagle", 2, 2, 1)
    assert not (tmp_path / "eagle").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
