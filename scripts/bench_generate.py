#!/usr/bin/env python
"""Time the reference runtime's ``generate``: per-sequence decoding vs batched decoding, in the same run.

stories260k converted to a float32 TRT-LLM checkpoint (tp/pp as asked) in a temporary folder; N prompts of
different lengths, M new tokens each, greedy, no end id (every sequence runs to M). Each mode is timed
``--repeats`` times and the best is reported; the two modes must return the same tokens.

    OMP_NUM_THREADS=1 python scripts/bench_generate.py --prompts 16 --new-tokens 32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.runtime import generate, load_checkpoint

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260k"
STORY = [1, 403, 407, 261, 378, 261, 300, 400, 410, 300, 261, 403]


def best_of(repeats: int, fn) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=STORIES)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_checkpoint(convert(a.model, Path(tmp) / "ckpt", tp=a.tp, pp=a.pp, dtype="float32"))
        prompts = [STORY[: 2 + i % len(STORY[2:])] for i in range(a.prompts)]  # lengths 2..12
        results = {}
        for batched in (False, True):
            secs, out = best_of(a.repeats, lambda b=batched: generate(model, prompts, a.new_tokens, batched=b))
            results[batched] = out
            tokens = sum(map(len, out))
            print(
                f"{'batched' if batched else 'per-sequence':>12}: {secs * 1000:7.1f} ms  {tokens / secs:8.0f} tok/s  "
                f"({a.prompts} prompts x {a.new_tokens} new tokens, tp={a.tp} pp={a.pp})"
            )
        assert results[True] == results[False], "batched and per-sequence tokens differ"
        print("same tokens: yes")


if __name__ == "__main__":
    main()
