#!/usr/bin/env python3
"""MTP and EAGLE-3 drafting on the CPU twin's executor, with and without, in one run.

Workloads (greedy, end id off, every request makes exactly ``--tokens`` tokens; max_draft_len 3):
- ``mtp-random``: the synthetic DeepSeek-V3 (trtpipe.models.synthetic "deepseek_v3", 3 layers, MLA + MoE) with a
  random MTP layer (trtpipe.models.synthetic_heads.add_mtp_layer); random prompts of 4-16 tokens.
- ``eagle3-random``: stories260k deepened to 8 layers (its layers 2-4 repeated: upstream's default EAGLE-3 capture
  needs more than 5) with a random EAGLE-3 head (make_eagle3_head); story openings.
- ``eagle3-trained``: the same target with an EAGLE-3 head trained here for ``--train-steps`` Adam steps on the
  target's own sampled text (teacher forcing of the first draft only: input (t[j+1], the target's layers 1, 3, 4
  at j), label t[j+2], over a draft vocabulary of the target's most frequent tokens, 1/4 of its vocabulary as the
  published Llama-3.1 head keeps); saved in the published layout and loaded by the twin like any head.
- ``eagle3-trained-tree``: the same trained head drafting the static tree ``TREE`` (``eagle_choices``, 6 nodes, 3
  deep as the chain: top-3 at depth 1, top-1 below the first two) instead of the chain of 3.
- ``eagle3-trained-dynamic``: the same trained head drafting EAGLE-2's dynamic tree (``dynamic_tree_max_top_k``
  ``DYNAMIC_K``, depth 3, the 6 best nodes: the static tree's size and depth; trtpipe/serving/dynamic_tree.py).

Per run: tokens per target forward (output tokens / target forwards each request took part in), acceptance rate,
ITL p50 and output tok/s (as scripts/bench_speculative.py, whose ``run`` this reuses), ratios against the same
workload and concurrency without speculation in this run.

    .venv/bin/python scripts/bench_hidden_draft.py [--requests 16] [--tokens 64] [--train-steps 400] [--json out]
        [--only eagle3-trained,eagle3-trained-tree,eagle3-trained-dynamic]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import OPENINGS, STORIES, print_table, run  # noqa: E402

TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]
DYNAMIC_K = 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic import make_synthetic
    from trtpipe.models.synthetic_heads import add_mtp_layer, deepened_llama, make_eagle3_head, train_eagle3_head
    from trtpipe.recipe.medusa import braces
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-heads-"))
    ds = make_synthetic("deepseek_v3", tmp / "ds", seed=3)
    add_mtp_layer(ds, make_synthetic("deepseek_v3", tmp / "blk", seed=5, num_hidden_layers=1, first_k_dense_replace=0))
    deep = deepened_llama(STORIES, tmp / "stories-8l")
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    g = torch.Generator().manual_seed(0)
    random_prompts = [
        [1] + torch.randint(3, 240, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 17, (args.requests,), generator=g)
    ]
    stories = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    trained, loss, accuracy = train_eagle3_head(deep, tmp / "head-trained", args.train_steps)
    print(
        f"eagle3-trained: last training loss {loss:.3f} after {args.train_steps} steps; held-out first-draft "
        f"accuracy {accuracy:.3f}"
    )
    workloads = {
        "mtp-random": (ds, random_prompts, {"speculative_decoding_type": "MTP", "max_draft_len": 3}),
        "eagle3-random": (
            deep,
            stories,
            {
                "speculative_decoding_type": "Eagle3",
                "max_draft_len": 3,
                "speculative_model": str(make_eagle3_head(deep, tmp / "head-random", seed=4)),
            },
        ),
        "eagle3-trained": (
            deep,
            stories,
            {"speculative_decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": str(trained)},
        ),
        "eagle3-trained-tree": (
            deep,
            stories,
            {
                "speculative_decoding_type": "Eagle3",
                "max_draft_len": len(TREE),
                "speculative_model": str(trained),
                "eagle_choices": braces(TREE),
            },
        ),
        "eagle3-trained-dynamic": (
            deep,
            stories,
            {
                "speculative_decoding_type": "Eagle3",
                "max_draft_len": len(TREE),  # the executor's: the tree's draft tokens (max_total_draft_tokens)
                "speculative_model": str(trained),
                "dynamic_tree_max_top_k": DYNAMIC_K,
                "dynamic_tree_depth": max(len(c) for c in TREE),
            },
        ),
    }
    if args.only:
        workloads = {k: v for k, v in workloads.items() if k in args.only.split(",")}
    rows = []
    for name, (model_dir, prompts, spec) in workloads.items():
        model = load_hf_checkpoint(model_dir)
        for c in (1, 8):
            base = run(model, prompts, args.tokens, c, {}, model_dir)
            with_spec = run(model, prompts, args.tokens, c, spec, model_dir)
            rows.append({"workload": name, "concurrency": c, "off": base, "on": with_spec})
    shutil.rmtree(tmp)
    print_table(rows)
    if args.json:
        args.json.write_text(
            json.dumps({"train_loss": loss, "heldout_first_draft_accuracy": accuracy, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
