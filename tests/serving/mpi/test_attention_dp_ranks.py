"""Attention data parallel one process per rank under a real mpiexec (trtpipe.serving.attention_dp): each rank runs
its own requests' attention and KV with whole attention weights; the MoE layers exchange tokens over the ranks' experts
(ep 2)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.fixture(scope="module")
def adp_models(tmp_path_factory):
    """kind -> (HF dir, its attention-DP 2 x ep 2 checkpoint); vocab 512 for the executor scenarios' token ids."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic

    root, out = tmp_path_factory.mktemp("adp"), {}
    for kind in ("deepseek_v3", "kimi_k2", "qwen3_moe", "gpt_oss"):
        hf = make_synthetic(kind, root / kind, seed=3, vocab_size=512, bos_token_id=1, eos_token_id=2)
        out[kind] = hf, convert(hf, root / f"{kind}_adp", tp=2, moe_ep=2, dtype="float32", attention_dp=True)
    return out


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k2", "qwen3_moe", "gpt_oss"])
def test_attention_dp_logits_and_greedy_text_as_transformers(run_mpi, adp_models, kind):
    """Three requests over two ranks (0, 1, 0): context and generation logits against transformers' float64 within
    4x its float32 error; greedy generation token for token as transformers' generate. DeepSeek-V3 and Kimi-K2 (MLA,
    shared experts), and two other MoE families the same mechanism serves: Qwen3-MoE (GQA, q/k norms) and gpt-oss
    (sinks, sliding layers, expert biases added once per expert by its rank)."""
    hf, ckpt = adp_models[kind]
    proc = run_mpi(2, "adp_check.py", hf, ckpt, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["logits_ok"] and out["greedy_ok"], out
    assert sorted(out["context_ranks"].values()) == [0, 0, 1]  # the requests were spread
    assert out["ranks_loaded"][0] == out["ranks_loaded"][1]  # the same bytes on each: whole attention, half the experts


def test_in_flight_executor_over_attention_dp_ranks(run_mpi, adp_models):
    """Rank 0's executor over the attention-DP ranks, scenario by scenario, against the one-process engine (itself
    held to transformers in tests/models/test_attention_dp.py): in-flight, chunked context, prefix reuse (a request
    reusing cached blocks must run on the rank holding them), a pool small enough to pause, n-gram speculation."""
    _, ckpt = adp_models["deepseek_v3"]
    proc = run_mpi(2, "executor_check.py", ckpt, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["equal"] for r in out.values()), out
    assert out["reuse"]["reused_blocks"] > 0 and out["max-util-tiny-pool"]["paused"] > 0
    assert out["ngram-speculation"]["accepted_drafts"] > 0


def test_openai_twin_over_attention_dp_ranks_serves_transformers_greedy_text(run_mpi, stories_dir, tmp_path):
    """The OpenAI twin on rank 0 with the attention-DP ranks as its step engine: four concurrent greedy completions
    over HTTP (both ranks hold requests) equal transformers' greedy text on the same weights."""
    import shutil

    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic

    hf = make_synthetic("deepseek_v3", tmp_path / "hf", seed=12, vocab_size=512, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(stories_dir / name, hf / name)
    ckpt = convert(hf, tmp_path / "adp", tp=2, moe_ep=2, dtype="float32", attention_dp=True)
    proc = run_mpi(2, "adp_openai_check.py", hf, ckpt, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ranks_used"] == [0, 1]
    texts = {k: v for k, v in out.items() if k != "ranks_used"}
    assert len(texts) == 4 and all(v["got"] == v["want"] and len(v["want"]) > 20 for v in texts.values()), texts
