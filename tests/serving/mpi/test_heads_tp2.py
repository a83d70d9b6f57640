"""MTP, EAGLE-3 and Medusa heads drafting for a tp 2 target split over two ranks under mpiexec
(tests/serving/mpi/heads_check.py runs on the ranks): rank 0's MPI step engine keeps the target's hidden states
(trtpipe/runtime/distributed.py ``RankModel.capture``), the head runs whole in rank 0's process.

Oracle: the one-process (tp 1) executor over the same HF weights. Greedy tokens at tp 2 with the head equal tp 1's
without speculation; the acceptance counters at tp 2 (drafts, accepted, verifications), greedy and sampled with a seed
per request, equal tp 1's with the same head, and so do the sampled tokens. The heads are random
(trtpipe.models.synthetic_heads): greedy accepts none of their drafts; sampled (rejection sampling against the heads'
distributions) MTP and EAGLE-3 accept some, which is what makes the counters' equality say something; Medusa's top-1
drafts accept none either way (its counters: the same drafts and verifications)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def head_models(tmp_path_factory, stories_dir):
    """kind -> (HF target dir, its float32 tp 2 checkpoint, head dir or '-')."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic import make_synthetic
    from trtpipe.models.synthetic_heads import add_mtp_layer, make_eagle3_head, make_medusa_heads

    root = tmp_path_factory.mktemp("heads_tp2")
    ds = make_synthetic("deepseek_v3", root / "ds", seed=3)
    add_mtp_layer(ds, make_synthetic("deepseek_v3", root / "blk", seed=5, num_hidden_layers=1, first_k_dense_replace=0))
    llama = make_synthetic("llama3", root / "llama", seed=1, num_hidden_layers=8)
    return {
        "mtp": (ds, convert(ds, root / "ds_tp2", tp=2, dtype="float32"), "-"),
        "eagle3": (
            llama,
            convert(llama, root / "llama_tp2", tp=2, dtype="float32"),
            make_eagle3_head(llama, root / "e3"),
        ),
        "medusa": (
            stories_dir,
            convert(stories_dir, root / "stories_tp2", tp=2, dtype="float32"),
            make_medusa_heads(stories_dir, root / "medusa", num_heads=4, seed=4),
        ),
    }


def _counters(run: dict) -> tuple:
    return run["drafts"], run["accepted"], run["verifications"]


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "medusa"])
def test_heads_at_tp2_under_mpiexec_keep_greedy_output_and_tp1_counters(run_mpi, head_models, kind):
    proc = run_mpi(2, "heads_check.py", kind, *head_models[kind], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = out["tp1_plain"]["tokens"]
    for run in ("tp1_spec", "tp2_plain", "tp2_spec"):
        assert out[run]["tokens"] == want, run
    assert sum(out["tp2_spec"]["drafts"]) > 0  # the head drafted over the ranks' hidden states
    assert _counters(out["tp2_spec"]) == _counters(out["tp1_spec"])
    assert out["tp2_sampled"]["tokens"] == out["tp1_sampled"]["tokens"]
    assert _counters(out["tp2_sampled"]) == _counters(out["tp1_sampled"])
    if kind != "medusa":  # rejection sampling keeps some of a random head's drafts
        assert sum(out["tp2_sampled"]["accepted"]) > 0


def test_heads_over_ranks_without_the_hidden_states_are_refused_in_one_line(tmp_path):
    """At pp > 1 rank 0 holds only its stage's layers, under attention DP only its own requests: refused when the
    drafter is built."""
    from trtpipe.runtime.distributed import RankLayout
    from trtpipe.serving.hidden_draft import require_hidden_states
    from trtpipe.serving.mpi_engine import RankEngine

    class Model:
        def __init__(self, pp, adp):
            self.layout = RankLayout(2 // pp, pp, 0)
            self.args = type("A", (), {"attention_dp": adp})()

    for pp, adp in ((2, False), (1, True)):
        engine = RankEngine.__new__(RankEngine)
        engine.model = Model(pp, adp)
        with pytest.raises(ValueError, match="at pp 1 without attention DP"):
            require_hidden_states(engine, "MTP / Eagle3")
    engine.model = Model(1, False)
    require_hidden_states(engine, "MTP / Eagle3")  # accepted: rank 0 of a pp 1 job


def test_medusa_at_tp2_through_the_openai_twin_keeps_greedy_text(run_mpi, head_models):
    """The OpenAI twin on rank 0 over the ranks' step engine (tests/serving/mpi/heads_openai_check.py): greedy
    completions with the Medusa heads are the text without them, and ``usage`` reports the drafts verified."""
    hf, ckpt, heads = head_models["medusa"]
    proc = run_mpi(2, "heads_openai_check.py", hf, ckpt, heads, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [t for t, _ in out["medusa"]] == [t for t, _ in out["plain"]]
    assert all(u["speculative_decoding"]["total_draft_tokens"] > 0 for _, u in out["medusa"])
