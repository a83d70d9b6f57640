#!/usr/bin/env python3
"""Medusa heads on the CPU twin's executor (stories260k), with and without, in one run.

Workloads (greedy, end id off, every request makes exactly ``--tokens`` tokens; max_draft_len 3, the chain
``[[0], [0, 0], [0, 0, 0]]``; story openings as prompts):
- ``medusa-random``: random heads (trtpipe.models.synthetic_heads.make_medusa_heads).
- ``medusa-fitted``: heads fitted here by ridge regression on the target's own sampled text: head ``i`` maps the
  target's final hidden state at position j to token j + 2 + i (one-hot targets, the residual block left at zero
  so it is the identity: ``x + silu(0 x + 0) = x``); saved in upstream's heads layout and loaded like any heads.
  Held-out top-1 accuracy per head is printed.

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
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-medusa-"))
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    prompts = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    fitted, accuracy = fit_medusa_heads(STORIES, tmp / "fitted", HEADS)
    print("medusa-fitted: held-out top-1 accuracy per head " + ", ".join(f"{a:.3f}" for a in accuracy))
    spec = {"speculative_decoding_type": "Medusa", "max_draft_len": HEADS}
    workloads = {
        "medusa-random": {**spec, "speculative_model": str(make_medusa_heads(STORIES, tmp / "random", HEADS, seed=4))},
        "medusa-fitted": {**spec, "speculative_model": str(fitted)},
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
        args.json.write_text(json.dumps({"heldout_accuracy": accuracy, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
