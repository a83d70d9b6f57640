"""Streaming: the converter's peak RSS does not grow with the number of layers (scripts/bench_convert.py
measures the same at Llama-3-70B shapes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from trtpipe.checkpoint.writer import RankFile

H, I, HEADS, KV, V = 2048, 8192, 16, 4, 4096
WORKER = """
import resource, sys, torch
torch.set_num_threads(1)
from trtpipe.checkpoint.convert import convert
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(sys.argv[1], sys.argv[2], tp=2)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def _write_llama(path, layers: int) -> int:
    """A bf16 Llama checkpoint written tensor by tensor; returns its bytes."""
    path.mkdir()
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        vocab_size=V,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        dtype="bfloat16",
    )
    (path / "config.json").write_text(json.dumps(cfg))
    d = H // HEADS
    shapes = [("model.embed_tokens.weight", (V, H)), ("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (H,)),
            (p + "post_attention_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (H, H)),
            (p + "self_attn.k_proj.weight", (KV * d, H)),
            (p + "self_attn.v_proj.weight", (KV * d, H)),
            (p + "self_attn.o_proj.weight", (H, H)),
            (p + "mlp.gate_proj.weight", (I, H)),
            (p + "mlp.up_proj.weight", (I, H)),
            (p + "mlp.down_proj.weight", (H, I)),
        ]
    f = RankFile(path / "model.safetensors", [(n, torch.bfloat16, s) for n, s in shapes])
    for name, shape in shapes:
        f.write(name, torch.randn(shape).bfloat16())
    f.close()
    return f.size


@pytest.mark.slow
def test_peak_rss_is_flat_in_the_number_of_layers(tmp_path):
    growth, size = {}, {}
    for layers in (2, 8):
        size[layers] = _write_llama(tmp_path / f"hf{layers}", layers)
        out = subprocess.run(
            [sys.executable, "-c", WORKER, str(tmp_path / f"hf{layers}"), str(tmp_path / f"ck{layers}")],
            check=True,
            capture_output=True,
            text=True,
        )
        growth[layers] = int(out.stdout.strip().splitlines()[-1])
    extra_input = size[8] - size[2]  # ~600 MB more weights
    assert extra_input > 500e6
    # the largest tensors are 32 MB; holding the model would add the 600 MB
    assert growth[8] - growth[2] < 100e6, (growth, size)
    assert growth[8] < 400e6, growth
