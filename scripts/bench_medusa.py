#!/usr/bin/env python3
"""Medusa heads on the CPU twin's executor (stories260k), with and without, in one run.

Workloads (greedy, end id off, every request makes exactly ``--tokens`` tokens; story openings as prompts; 3 heads):
- ``medusa-random``: random heads (trtpipe.models.synthetic_heads.make_medusa_heads), the chain
  ``[[0], [0, 0], [0, 0, 0]]`` (max_draft_len 3).
- ``medusa-fitted``: heads fitted by ridge regression on the target's own sampled text
  (trtpipe.models.synthetic_heads.fit_medusa_heads; held-out top-1 accuracy per head is printed), the same chain.
- ``medusa-fitted-tree10``: the same heads, the first 10 choices of upstream's ``mc_sim_7b_63`` (max_draft_len 10).
- ``medusa-fitted-tree61``: the same heads, ``mc_sim_7b_63`` without its two 4-deep paths (3 heads; max_draft_len 61).

Per run (scripts/bench_speculative.py's ``run``): tokens per target forward, acceptance rate, ITL p50 and output
tok/s, and ratios against the same workload and concurrency without speculation in this run.

    .venv/bin/python scripts/bench_medusa.py [--requests 16] [--tokens 64] [--json out]
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

HEADS = 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic_heads import fit_medusa_heads, make_medusa_heads
    from trtpipe.recipe.medusa import MC_SIM_7B_63
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-medusa-"))
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    prompts = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    fitted, accuracy = fit_medusa_heads(STORIES, tmp / "fitted", HEADS)
    print("medusa-fitted: held-out top-1 accuracy per head " + ", ".join(f"{a:.3f}" for a in accuracy))
    spec = {"speculative_decoding_type": "Medusa", "max_draft_len": HEADS}
    tree61 = [c for c in MC_SIM_7B_63 if len(c) <= HEADS]
    workloads = {
        "medusa-random": {**spec, "speculative_model": str(make_medusa_heads(STORIES, tmp / "random", HEADS, seed=4))},
        "medusa-fitted": {**spec, "speculative_model": str(fitted)},
        "medusa-fitted-tree10": {**spec, "speculative_model": str(fitted), "max_draft_len": 10},
        "medusa-fitted-tree61": {**spec, "speculative_model": str(fitted), "max_draft_len": len(tree61)},
    }
    workloads["medusa-fitted-tree10"]["medusa_choices"] = MC_SIM_7B_63[:10]
    workloads["medusa-fitted-tree61"]["medusa_choices"] = tree61
    model = load_hf_checkpoint(STORIES)
    rows = []
    for c in (1, 8):
        base = run(model, prompts, args.tokens, c, {}, STORIES)
        for name, s in workloads.items():
            rows.append({"workload": name, "concurrency": c, "off": base, "on": run(model, prompts, args.tokens, c, s)})
    shutil.rmtree(tmp)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"heldout_accuracy": accuracy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
