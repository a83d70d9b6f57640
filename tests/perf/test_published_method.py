"""How a published row becomes a deployment and a KV pool: the parts of the method that depend on the page."""

from __future__ import annotations

import pytest

from trtpipe.perf.published import PUBLISHED_CSV, deployment_of, kv_capacity_tokens, limits_of, read_rows


def _row(**over) -> dict:
    row = {
        "source_file": "x",
        "commit_or_date": "x",
        "trtllm_version": "1.0",
        "backend": "pytorch:trtllm-bench",
        "model": "Qwen3-235B-A22B",
        "precision": "FP8",
        "gpu": "H100 SXM 80GB",
        "num_gpus": "8",
        "tp": "8",
        "pp": "1",
        "ep": "",
        "isl": "1000",
        "osl": "1000",
        "metric": "output_tok_s_total",
        "concurrency_or_batch": "max-load",
        "value": "1",
    }
    row.update(over)
    return row


def test_the_1_0_pages_moe_rows_run_expert_parallel_over_their_tp_ranks():
    """The 1.0 page's MoE command passes --ep while its tables name only TP: the experts are spread over the tp ranks
    (with attention DP); later pages state ep themselves, earlier ones keep the LLM API's MoE-TP default."""
    assert deployment_of(_row()).ep == 8 and deployment_of(_row()).attn_dp
    assert deployment_of(_row(trtllm_version="0.20")).ep == 1
    assert deployment_of(_row(ep="4", tp="8")).ep == 4
    assert deployment_of(_row(model="Llama 3.3 70B")).ep == 1  # dense: nothing to spread


def test_the_pytorch_kv_pool_leaves_room_for_the_profiling_pass_and_the_engine_pool_does_not():
    row = _row()
    d = deployment_of(row)
    lim = limits_of(row, d, 1000, 1000)
    act = d.profiling_activation_bytes(lim.max_num_tokens)
    assert act > 1e9  # 8 ranks x max_num_tokens x top-8 fused-MoE rows
    full = kv_capacity_tokens(d, 0.9, 2.0)
    assert full - kv_capacity_tokens(d, 0.9, 2.0, lim.max_num_tokens) == pytest.approx(
        act * 0.9 / d.kv_bytes_per_token, abs=1
    )
    assert not deployment_of(_row(backend="engine:trtllm-bench")).pytorch_backend


def test_every_published_pytorch_row_has_a_kv_pool_after_the_profiling_pass():
    rows = [
        r
        for r in read_rows(PUBLISHED_CSV)
        if r["backend"].startswith("pytorch:") and r["concurrency_or_batch"] == "max-load"
    ]
    assert len(rows) > 1100
    for r in rows:
        d = deployment_of(r)
        lim = limits_of(r, d, int(r["isl"]), int(r["osl"]))
        assert kv_capacity_tokens(d, lim.kv_fraction, 2.0, lim.max_num_tokens) > int(r["isl"]) + int(r["osl"]), r
