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
RIDGE = 1e-2


def fit_heads(target: Path, out: Path, seed: int = 0) -> tuple[Path, list[float]]:
    """Medusa heads fitted to the target's sampled text; returns the directory and each head's held-out accuracy."""
    from safetensors.torch import load_file, save_file

    from trtpipe.models.synthetic import load_hf
    from trtpipe.models.synthetic_heads import make_medusa_heads

    torch.manual_seed(seed)
    hf = load_hf(target)
    V = hf.config.vocab_size
    with torch.no_grad():  # 1,024 samples of 64 tokens from BOS; the last 128 held out
        seqs = hf.generate(
            torch.ones(1024, 1, dtype=torch.long), do_sample=True, max_new_tokens=64, min_new_tokens=64, pad_token_id=0
        )
        h = hf.model(seqs).last_hidden_state.double()  # after the final norm: what the heads read
    heads = make_medusa_heads(target, out, num_heads=HEADS, seed=seed)
    t = load_file(str(heads / "medusa_lm_head.safetensors"))
    train, accuracy = seqs.shape[0] - 128, []
    for i in range(HEADS):
        x = h[:, : -(2 + i)]  # position j predicts t[j + 2 + i]
        y = seqs[:, 2 + i :]
        xt, yt = x[:train].reshape(-1, x.shape[-1]), y[:train].reshape(-1)
        xty = torch.zeros(x.shape[-1], V, dtype=torch.float64).index_add_(1, yt, xt.T)  # x^T one-hot(y)
        w = torch.linalg.solve(xt.T @ xt + RIDGE * len(yt) * torch.eye(x.shape[-1], dtype=torch.float64), xty)
        t[f"{i}.0.linear.weight"].zero_()
        t[f"{i}.0.linear.bias"].zero_()
        t[f"{i}.1.weight"] = w.T.float().contiguous()
        xh, yh = x[train:].reshape(-1, x.shape[-1]), y[train:].reshape(-1)
        accuracy.append(float(((xh @ w).argmax(-1) == yh).double().mean()))
    save_file(t, str(heads / "medusa_lm_head.safetensors"))
    return heads, accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic_heads import make_medusa_heads
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench-medusa-"))
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    prompts = [tok.encode(OPENINGS[i % len(OPENINGS)]) for i in range(args.requests)]
    fitted, accuracy = fit_heads(STORIES, tmp / "fitted")
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
