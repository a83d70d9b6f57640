#!/usr/bin/env python3
"""EAGLE-1/2 heads on the CPU twin's executor (stories260k): off, the chain and a static tree, in one run.

Workloads (greedy, every request makes exactly ``--tokens`` tokens; story openings as prompts), each with the head
of trtpipe.models.synthetic_heads.fit_eagle1_head (``fc`` ridge-fitted on the target's own sampled text, the
layers' outputs zeroed: a linear drafter):
- ``eagle-chain``: max_draft_len 3, eagle_choices the chain ``[[0], [0, 0], [0, 0, 0]]``;
- ``eagle-tree``: max_draft_len 7, ``[[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]`` (verified with the tree
  mask, trtpipe.serving.tree_verify).

Per run (scripts/bench_speculative.py's ``run``): tokens per target forward, acceptance rate, ITL p50 and output
tok/s, and ratios against the same concurrency without speculation in this run.

    .venv/bin/python scripts/bench_eagle1.py [--requests 16] [--tokens 64] [--json out]
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

TREES = {
    "eagle-chain": [[0], [0, 0], [0, 0, 0]],
    "eagle-tree": [[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic_heads import fit_eagle1_head
    from trtpipe.recipe.medusa import braces
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-eagle1-"))
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    prompts = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    head = fit_eagle1_head(STORIES, tmp / "head")
    workloads = {
        name: {
            "speculative_decoding_type": "Eagle",
            "max_draft_len": len(tree),
            "speculative_model": str(head),
            "eagle_choices": braces(tree),
        }
        for name, tree in TREES.items()
    }
    model = load_hf_checkpoint(STORIES)
    rows = []
    for c in (1, 8):
        base = run(model, prompts, args.tokens, c, {}, STORIES)
        for name, s in workloads.items():
            rows.append({"workload": name, "concurrency": c, "off": base, "on": run(model, prompts, args.tokens, c, s)})
    shutil.rmtree(tmp)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
