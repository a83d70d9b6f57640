"""Medusa trees, EAGLE-1 chains and trees and lookahead decoding for a tp 2 target split over two ranks under mpiexec
(tests/serving/mpi/tree_spec_check.py runs on the ranks): each step's token set travels to the ranks with its mask and
positions (trtpipe/serving/mpi_engine.py ``wire``), every rank moves the accepted drafts' KV in its shard
(``move_slots`` is broadcast), the heads draft whole on rank 0 from its captured hidden states, and rank 0 computes
what the executor reads of the step (the accepted path, ``kept``, lookahead's ``targets``).

Oracle: the one-process (tp 1) executor over the same HF weights. Greedy tokens at tp 2 with speculation equal tp 1's
without; the acceptance counters at tp 2 (drafts, accepted, verifications) equal tp 1's with the same drafter, greedy
and (heads) sampled with a seed per request, and so do the sampled tokens. The heads are fitted to the target's own
text (trtpipe.models.synthetic_heads ``fit_medusa_heads`` / ``fit_eagle1_head``) and lookahead's prompts repeat a
phrase, so drafts are accepted and the counters' equality says something."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def tree_models(tmp_path_factory, stories_dir):
    """(tp 2 float32 checkpoint, kind -> head dir or '-')."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.models.synthetic_heads import fit_eagle1_head, fit_medusa_heads

    root = tmp_path_factory.mktemp("trees_tp2")
    medusa = fit_medusa_heads(stories_dir, root / "medusa", 4, samples=256, length=48)[0]
    eagle = fit_eagle1_head(stories_dir, root / "eagle1", samples=128)
    heads = {"medusa_tree": medusa, "eagle_chain": eagle, "eagle_tree": eagle, "lookahead": "-"}
    return convert(stories_dir, root / "stories_tp2", tp=2, dtype="float32"), heads


@pytest.mark.parametrize("kind", ["medusa_tree", "eagle_chain", "eagle_tree", "lookahead"])
def test_trees_and_lookahead_at_tp2_under_mpiexec_keep_greedy_output_and_tp1_counters(
    run_mpi, tree_models, stories_dir, kind
):
    ckpt, heads = tree_models
    proc = run_mpi(2, "tree_spec_check.py", kind, stories_dir, ckpt, heads[kind], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = out["tp1_plain"]["tokens"]
    for run in ("tp1_spec", "tp2_plain", "tp2_spec"):
        assert out[run]["tokens"] == want, run
    counters = ("drafts", "accepted", "verifications")
    assert [out["tp2_spec"][c] for c in counters] == [out["tp1_spec"][c] for c in counters]
    assert sum(out["tp2_spec"]["accepted"]) > 0  # drafts were kept, so their KV moved on both ranks
    if kind != "lookahead":
        assert out["tp2_sampled"]["tokens"] == out["tp1_sampled"]["tokens"]
        assert [out["tp2_sampled"][c] for c in counters] == [out["tp1_sampled"][c] for c in counters]


def test_the_whole_lm_head_of_a_rank_needs_pp1_and_the_checkpoint(tmp_path):
    """An EAGLE-1/2 head on rank 0 reads the other tp ranks' lm_head from the checkpoint: without it, or at pp > 1
    (rank 0 holds no lm_head), one line; a missing tensor names the rank file."""
    from safetensors.torch import save_file

    from trtpipe.errors import CheckpointError
    from trtpipe.runtime.distributed import RankLayout, RankModel, whole_lm_head

    model = RankModel.__new__(RankModel)
    model.args = type("A", (), {"attention_dp": False})()
    for pp, where in ((2, tmp_path), (1, None)):
        model.layout = RankLayout(2, pp, 0)
        with pytest.raises(ValueError, match="needs pp 1 and its checkpoint directory"):
            whole_lm_head(model, where)
    save_file({"lm_head.weight": torch.zeros(4, 2)}, str(tmp_path / "rank0.safetensors"))
    save_file({"transformer.ln_f.weight": torch.ones(2)}, str(tmp_path / "rank1.safetensors"))
    with pytest.raises(CheckpointError, match=r"rank1\.safetensors: tensor 'lm_head\.weight' is missing"):
        whole_lm_head(model, tmp_path)
