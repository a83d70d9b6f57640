#!/usr/bin/env python3
"""Lookahead decoding on the CPU twin's executor (stories260k), with and without, in one run.

Workloads (greedy, end id off, every request makes exactly ``--tokens`` tokens; scripts/bench_speculative.py's
``run``: a closed loop of C clients over the threaded executor, one torch thread):
- ``lookahead-repeated``: the repetitive prompt set of bench_speculative's ``ngram`` workload (a sentence said three
  times, then its start), lookahead (W 4, N 3, G 4: upstream's executor defaults, 15 drafts a step);
- ``ngram-repeated``: the same prompts with NGram drafting (max_draft_len 3, max_matching_ngram_size 2), for
  comparison;
- ``lookahead-openings``: story openings (no repetition in the prompt), lookahead (4, 3, 4).

Per run: tokens per target forward (output tokens / target forwards each request took part in), acceptance rate
(accepted / drafted tokens: lookahead drafts its whole window and verification set every step), ITL p50, output
tok/s, and ratios against the same workload and concurrency without speculation, in this run.

    .venv/bin/python scripts/bench_lookahead.py [--requests 16] [--tokens 64] [--json out]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import OPENINGS, REPEATED, STORIES, print_table, run  # noqa: E402

W, N, G = 4, 3, 4


def lookahead(w: int, n: int, g: int) -> dict:
    """The executor knobs of lookahead (W, N, G): its draft length is upstream's calculateSpeculativeResource."""
    from trtpipe.recipe.lookahead import LookaheadConfig

    return {"speculative_decoding_type": "Lookahead", **LookaheadConfig(w, n, g).executor_fields()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    model = load_hf_checkpoint(STORIES)

    def ids(texts):
        return [tok.encode(texts[i % len(texts)]) for i in range(args.requests)]

    repeated = ids([f"{s} {s} {s} {' '.join(s.split()[:2])}" for s in REPEATED])
    workloads = {
        "lookahead-repeated": (repeated, lookahead(W, N, G)),
        "ngram-repeated": (
            repeated,
            {"speculative_decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2},
        ),
        "lookahead-openings": (ids(OPENINGS), lookahead(W, N, G)),
    }
    rows = []
    for name, (prompts, spec) in workloads.items():
        for c in args.concurrency:
            off = run(model, prompts, args.tokens, c, {})
            on = run(model, prompts, args.tokens, c, spec)
            rows.append({"workload": name, "concurrency": c, "off": off, "on": on})
            print(f"{name} C={c}: {on['tokens_per_target_forward']:.2f} tokens/forward", file=sys.stderr)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
