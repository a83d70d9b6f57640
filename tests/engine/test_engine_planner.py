"""Planner arithmetic against hand-computed values from the published configs (recipes/configs/*)."""

from __future__ import annotations

import math

import pytest

from engine_helpers import hf_config
from trtpipe.engine import build_config as bc
from trtpipe.engine import planner
from trtpipe.engine.ckptconfig import predicted_checkpoint_config
from trtpipe.formats.gpus import get_gpu
from trtpipe.models.dims import parse_hf_config
from trtpipe.recipe.schema import Recipe

KiB, GiB = 1024, 1 << 30


def setup(
    model: str,
    tp: int = 1,
    pp: int = 1,
    algo: str = "none",
    kv: str = "none",
    gpu: str = "h100-sxm-80gb",
    dtype: str = "auto",
    **engine,
):
    r = Recipe.model_validate(
        {
            "name": "t",
            "model": {"source": "/x", "dtype": dtype},
            "quantization": {"algo": algo, "kv_cache": kv},
            "parallel": {"tp": tp, "pp": pp},
            "engine": {"gpu": gpu, **engine},
        }
    )
    cfg = predicted_checkpoint_config(parse_hf_config(hf_config(model)), r)
    build = bc.resolve_build(r, cfg)
    return r, cfg, build, planner.plan_build(r, cfg, build)


def test_llama3_8b_kv_bytes_per_token_published_values():
    _, _, _, p = setup("llama-3-8b")
    assert p.kv_bytes_per_token_model == 128 * KiB == 2 * 32 * 8 * 128 * 2
    _, _, _, p8 = setup("llama-3-8b", kv="fp8", algo="fp8")
    assert p8.kv_bytes_per_token_model == 64 * KiB


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("kv,size", [("none", 2), ("fp8", 1)])
def test_llama3_70b_kv_per_gpu(tp, kv, size):
    _, _, _, p = setup("llama-3.1-70b", tp=tp, kv=kv, algo="fp8" if kv == "fp8" else "none", workers=1)
    # 80 layers, 8 KV heads split over tp (8 divides by 1, 2, 4, 8), head 128
    assert p.ranks[0].kv_bytes_per_token == 2 * 80 * (8 // tp) * 128 * size
    assert p.kv_bytes_per_token_model == 2 * 80 * 8 * 128 * size
    if kv == "fp8":
        assert p.kv_bytes_per_token_model == 160 * KiB  # "70B FP8 KV ~ 160 KB/token"


def test_gqa_kv_heads_fewer_than_tp_are_replicated():
    # Llama-3-8B at tp=16: 8 KV heads < 16 ranks, each rank stores one whole (duplicated) KV head
    _, _, _, p = setup("llama-3-8b", tp=16, workers=1)
    assert p.ranks[0].kv_bytes_per_token == 2 * 32 * 1 * 128 * 2 == 16 * KiB
    assert p.ranks[0].kv_bytes_per_token * 16 == 2 * p.kv_bytes_per_token_model  # twice the unreplicated total
    # stories260k-shaped: 4 KV heads, tp 8 -> ceil(4/8) = 1 head per rank
    s = planner.Shapes(
        hidden=64,
        layers=5,
        heads=8,
        kv_heads=4,
        head_size=8,
        intermediate=172,
        vocab=512,
        experts=0,
        top_k=0,
        dtype="float16",
        quant_algo=None,
        kv_quant=None,
        group_size=128,
        parallel_embedding=False,
    )
    assert planner.kv_bytes_per_token(s, 5, 8) == 2 * 5 * 1 * 8 * 2 == 160


def test_pipeline_parallel_splits_layers_like_tensor_split():
    assert planner.pp_layers(80, 3) == [27, 27, 26]
    _, _, _, p = setup("llama-3.1-70b", tp=2, pp=3, kv="fp8", algo="fp8", workers=1)
    assert [r.layers for r in p.ranks] == [27, 27, 26]
    assert [r.kv_bytes_per_token for r in p.ranks] == [2 * n * 4 * 128 for n in (27, 27, 26)]
    assert p.kv_blocks == min(r.kv_blocks for r in p.ranks)


def test_llama2_7b_fp16_weights_about_13_5_gb():
    cfg = {
        "architecture": "LlamaForCausalLM",
        "dtype": "float16",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "head_size": 128,
    }
    total = planner.weight_bytes(planner.Shapes.of(cfg), 1, 1)[0]
    per_layer = 4096 * 96 * 128 + 32 * 128 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert total == 2 * (32 * per_layer + 2 * 32000 * 4096 + 4096) == 13_476_831_232
    assert round(total / 1e9, 1) == 13.5


def test_llama3_8b_full_plan_on_h100_hand_computed():
    r, cfg, build, p = setup("llama-3-8b")  # bf16, tp1, max_num_tokens 8192, batch 64
    params = 32 * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096
    assert params == 8_030_261_248
    rank = p.ranks[0]
    assert rank.weight_bytes == 2 * params
    act = 8192 * (3 * 4096 + 48 * 128 + 2 * 14336) * 2 + 64 * 128256 * 4
    assert rank.activation_bytes == act == 804_585_472
    free = 81559 * 2**20 - 2 * params - act - GiB
    assert rank.free_bytes == free
    tokens = int(free * 0.9) // (128 * KiB)
    assert p.kv_tokens == tokens == 464_048
    assert p.kv_blocks == math.ceil(tokens / 32) == 14_502
    assert p.blocks_per_sequence == 8192 // 32
    assert p.concurrent_sequences == 14_502 // 256 == 56
    assert p.fits


def test_max_tokens_caps_the_pool():
    _, _, _, p = setup("llama-3-8b", kv_cache={"max_tokens": 10_000, "tokens_per_block": 64})
    assert p.kv_tokens == 10_000 and p.kv_blocks == math.ceil(10_000 / 64) == 157


def test_llama3_70b_fp8_tp4_h100_fits_and_tp1_rtx4090_is_refused():
    _, _, _, p = setup("llama-3.1-70b", tp=4, algo="fp8", kv="fp8", max_seq_len=8192, max_input_len=4096, workers=4)
    attn = 8192 * (16 + 2 * 2) * 128 + 16 * 128 * 8192
    per_layer = (attn + 3 * 8192 * 28672 // 4) * 1 + 2 * 8192 * 2
    assert p.ranks[0].weight_bytes == 80 * per_layer + 128256 * 8192 * 2 + (128256 // 4) * 8192 * 2 + 8192 * 2
    assert p.fits and p.concurrent_sequences > 64
    _, _, _, q = setup(
        "llama-3.1-70b",
        tp=1,
        algo="fp8",
        kv="fp8",
        gpu="rtx-4090-24gb",
        max_seq_len=8192,
        max_input_len=4096,
        workers=1,
    )
    assert not q.fits
    assert q.refusal.startswith("does not fit: per-GPU weights 67.7 GiB")
    assert "parallel.tp: 4" in q.refusal


def test_kv_refusal_names_the_kv_knobs():
    # Llama-3-8B bf16 on one L4 (24 GB) with a 128k context: weights fit, one sequence of KV does not
    _, _, _, p = setup(
        "llama-3-8b", gpu="l4-24gb", max_seq_len=131072, max_input_len=1024, max_batch_size=8, max_num_tokens=2048
    )
    assert not p.fits and "cannot hold one sequence of max_seq_len 131072 (4096 blocks)" in p.refusal
    tokens = p.kv_tokens
    assert f"KV pool ({tokens} tokens" in p.refusal and f"engine.max_seq_len <= {tokens // 32 * 32}" in p.refusal
    assert "parallel.tp: 2" in p.refusal
    assert "quantization.kv_cache: fp8" not in p.refusal  # 131072 x 64 KiB does not fit either
    _, _, _, half = setup(
        "llama-3-8b", gpu="l4-24gb", max_seq_len=65536, max_input_len=1024, max_batch_size=8, max_num_tokens=2048
    )
    assert not half.fits and "quantization.kv_cache: fp8" in half.refusal  # 65536 x 64 KiB does


def test_mixtral_8x7b_weights_and_kv():
    _, cfg, _, p = setup("mixtral-8x7b", tp=2, workers=1)
    attn = 4096 * (16 + 2 * 4) * 128 + 16 * 128 * 4096
    per_layer = (attn + 3 * 4096 * 14336 * 8 // 2) * 2 + 4096 * 8 * 4 + 2 * 4096 * 2
    assert p.ranks[0].weight_bytes == 32 * per_layer + 32000 * 4096 * 2 + 16000 * 4096 * 2 + 4096 * 2
    assert p.ranks[0].kv_bytes_per_token == 2 * 32 * 4 * 128 * 2 == 64 * KiB
    full = planner.weight_bytes(planner.Shapes.of({**cfg, "mapping": {}}), 1, 1)[0]
    assert round(full / 2 / 1e9, 1) == 46.7  # Mixtral-8x7B has 46.7B parameters
    assert p.fits and p.host_bytes["engine"] == 2 * p.ranks[0].weight_bytes


def test_awq_weights_count_group_scales():
    _, _, _, p = setup("llama-3-8b", algo="int4_awq")
    linear = 32 * (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336)
    other = 32 * 2 * 4096 * 2 + 2 * 128256 * 4096 * 2 + 4096 * 2
    assert p.ranks[0].weight_bytes == int(linear * 0.5 + linear * 2 / 128 + other)


def test_checkpoint_weight_bytes_from_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {"a": torch.zeros(10, 4, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float32)},
        str(tmp_path / "rank0.safetensors"),
    )
    save_file({"a": torch.zeros(12, 4, dtype=torch.float16)}, str(tmp_path / "rank1.safetensors"))
    assert planner.checkpoint_weight_bytes(tmp_path, 2, 1) == [12 * 4 * 2]
    assert planner.checkpoint_weight_bytes(tmp_path, 1, 2) == [10 * 4 * 2 + 3 * 4, 12 * 4 * 2]


def test_beam_blocks_share_context():
    assert planner.blocks_per_sequence(1024, 512, 32, 1) == 32
    assert planner.blocks_per_sequence(1024, 512, 32, 4) == 16 + 16 * 4


def test_gpu_catalog_lookup():
    from trtpipe.formats.gpus import CATALOG
    from trtpipe.errors import EngineError

    assert get_gpu("H100_SXM_80GB").key == "h100-sxm-80gb" and get_gpu("h100").sm == 90
    assert get_gpu("rtx-4090").memory_bytes == 24564 << 20 and get_gpu("rtx-4090").arch == "ada"
    assert get_gpu("b200").arch == "blackwell" and get_gpu("a10g-24gb").compute_capability == "8.6"
    assert len({g.key for g in CATALOG}) == len(CATALOG)
    with pytest.raises(EngineError, match="did you mean 'l40s-48gb'"):
        get_gpu("l40s-48")


def test_sliding_window_bounds_the_blocks_of_a_sequence():
    # Mistral-style: the KV cache of a sequence holds min(seq_len, attention window) tokens (contract §5.7)
    r, cfg, build, p = setup("llama-3-8b", max_seq_len=32768, max_input_len=1024, max_num_tokens=8192)
    assert p.blocks_per_sequence == 32768 // 32
    windowed = {**cfg, "sliding_window": 4096}
    q = planner.plan_build(r, windowed, bc.resolve_build(r, windowed))
    assert q.blocks_per_sequence == 4096 // 32
    assert q.kv_blocks == p.kv_blocks and q.concurrent_sequences == q.kv_blocks // 128
    wide = {**cfg, "sliding_window": 100_000}  # wider than max_seq_len: no effect
    assert planner.plan_build(r, wide, bc.resolve_build(r, wide)).blocks_per_sequence == 32768 // 32


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\x05\x00", "truncated safetensors file (2 bytes, no header)"),
        (b"\xff" * 6 + b"\0\0{}", "truncated safetensors file (header of 281474976710655 bytes, file of 10)"),
        (b"\x07" + b"\0" * 7 + b'{"a":1}', "invalid safetensors header"),
        (b"\x07" + b"\0" * 7 + b"[1,2,3]", "invalid safetensors header"),
        (b"\x06" + b"\0" * 7 + b'{"a":1', "invalid safetensors header"),
    ],
)
def test_checkpoint_weight_bytes_refuses_a_bad_header(tmp_path, content, message):
    from trtpipe.errors import EngineError

    (tmp_path / "rank0.safetensors").write_bytes(content)
    with pytest.raises(EngineError) as err:
        planner.checkpoint_weight_bytes(tmp_path, 1, 1)
    assert str(err.value).startswith(f"{tmp_path / 'rank0.safetensors'}: {message}"), str(err.value)


def test_checkpoint_weight_bytes_refuses_a_truncated_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    from trtpipe.errors import EngineError

    save_file({"a": torch.zeros(100, 4, dtype=torch.float16)}, str(tmp_path / "rank0.safetensors"))
    data = (tmp_path / "rank0.safetensors").read_bytes()
    (tmp_path / "rank0.safetensors").write_bytes(data[:-10])
    with pytest.raises(
        EngineError, match=rf"rank0.safetensors: truncated: tensor 'a' ends at byte {len(data)} of {len(data) - 10}"
    ):
        planner.checkpoint_weight_bytes(tmp_path, 1, 1)
