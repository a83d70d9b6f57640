"""A DraftTarget draft sharded at tp 2 beside a tp 2 target under mpiexec (trtpipe/serving/mpi_engine.py
``draft_step_engine``; tests/serving/mpi/draft_check.py runs on the ranks): greedy tokens equal the one-process
executor without speculation, for the model as its own draft and for a 2-layer cut of it; the self-draft accepts
every draft of the hand trace (20 tokens, k 3: 14 drafts in 5 verifications per request, as
tests/serving/test_speculative.py works out)."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def cut_draft_tp2(tmp_path_factory, stories_dir):
    """stories260k cut to its first 2 layers (the target's tokenizer, another distribution), converted at tp 2."""
    from safetensors.torch import load_file, save_file

    from trtpipe.checkpoint.convert import convert

    d = tmp_path_factory.mktemp("cut") / "stories-2l"
    shutil.copytree(stories_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(d / "model.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    save_file(keep, d / "model.safetensors", metadata={"format": "pt"})
    return convert(d, tmp_path_factory.mktemp("cut_ckpt") / "tp2", tp=2, dtype="float16")


def test_a_draft_sharded_over_the_targets_ranks_keeps_greedy_output(run_mpi, stories_ckpt, cut_draft_tp2):
    target = stories_ckpt(2, 1)
    proc = run_mpi(2, "draft_check.py", target, target, cut_draft_tp2, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["self"]["equal"] and out["other"]["equal"], out
    assert out["self"]["drafts"] == [14] * 4 and out["self"]["accepted"] == [14] * 4
    assert out["self"]["verifications"] == 4 * 5
    assert sum(out["other"]["drafts"]) > 0 and 0 < sum(out["other"]["accepted"]) < sum(out["other"]["drafts"])


def test_a_draft_in_another_layout_is_refused(run_mpi, stories_ckpt):
    """The draft runs on the target's ranks: a tp 1 draft beside a tp 2 target is one clear error."""
    from trtpipe.runtime.distributed import RankLayout
    from trtpipe.serving.mpi_engine import draft_step_engine

    class Fake:  # only the layouts are read before anything is built
        def __init__(self, tp, pp):
            self.layout = RankLayout(tp, pp, 0)

    class Target:
        model = Fake(2, 1)
        _lock = None

    with pytest.raises(ValueError, match=r"draft checkpoint tp 1 x pp 1 must be the target's layout \(tp 2 x pp 1\)"):
        draft_step_engine(Target(), Fake(1, 1))


def test_tree_verification_moves_the_kv_on_every_rank(run_mpi, stories_ckpt):
    """tests/serving/mpi/tree_check.py: a tree verified at tp 2, its accepted drafts' KV moved on both ranks, then one
    decode step: the logits equal the one-process chain of the accepted path within its float32 error."""
    proc = run_mpi(2, "tree_check.py", stories_ckpt(2, 1))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rows_err"] <= out["rows_bound"] and out["after_err"] <= out["after_bound"], out
