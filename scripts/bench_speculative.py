#!/usr/bin/env python3
"""Speculative decoding on the CPU twin's executor, with and without, in one run.

stories260k is the target (float32, the reference runtime, one torch thread). Two workloads:
- ``ngram``: a repetitive prompt set (a sentence said three times, then its start), NGram drafting
  (max_draft_len 3, max_matching_ngram_size 2);
- ``draft-int4``: story openings, DraftTarget with stories260k quantized INT4 AWQ through the pipeline as the draft
  (``trtpipe build recipes/stories-llmapi-fp8.yaml --set quantization.algo=int4_awq ... --until export``: its
  unified HF export; on the CPU twin it is dequantized at load, so it costs what the target costs);
- ``draft-2layer``: story openings, DraftTarget with stories260k cut to its first 2 of 5 layers (same tokenizer; a
  cheaper, much worse model), max_draft_len 3.
Each workload runs with speculation off and on, at concurrency 1 and 8 (a closed loop of C clients over the
threaded executor, greedy, end id off so every request makes exactly ``--tokens`` tokens), in the same process.

Per run: tokens per target forward (output tokens / target forwards each request took part in: its prefill and
every generation step; 1.0 without speculation), acceptance rate, ITL p50 (per request (last token - first token) /
(tokens - 1), the executor's steady clock), output tokens/s (all output tokens / wall time). Ratios are against
the same workload and concurrency without speculation, in this run.

    .venv/bin/python scripts/bench_speculative.py [--requests 16] [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "models" / "stories260k"
REPEATED = [
    "The cat sat on the mat.",
    "Tom has a red ball.",
    "The sun is big and hot.",
    "Lily likes to play in the park.",
    "The dog ran to the tree.",
    "Mom made a cake for Ben.",
    "The bird sang a happy song.",
    "Sam saw a big fish in the water.",
]
OPENINGS = [
    "Once upon a time, there was a little girl named Lily.",
    "One day, a boy named Tom went to the park.",
    "There was a big dog who liked to run.",
    "Once upon a time, in a small house, lived a cat.",
    "Sue wanted to play with her friend.",
    "The sun was shining and the birds were singing.",
    "Max found a shiny rock in the garden.",
    "Mia and her mom went to the store.",
]


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def shrunk_draft(out: Path, layers: int = 2) -> Path:
    """stories260k with only its first ``layers`` decoder layers."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(STORIES, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    sd = load_file(out / "model.safetensors")
    keep = {k: v for k, v in sd.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return out


def int4_draft(work: Path) -> Path:
    """stories260k INT4 AWQ (group 64; mlp.proj, 172 inputs, and lm_head left unquantized), exported for llmapi."""
    import subprocess
    import sys

    sets = {
        "name": "stories-int4-draft",
        "work_dir": str(work),
        "quantization.algo": "int4_awq",
        "quantization.kv_cache": "none",
        "quantization.group_size": "64",
        "quantization.exclude": '["*lm_head","*mlp.proj"]',
    }
    argv = [sys.executable, "-m", "trtpipe.cli", "build", str(REPO / "recipes" / "stories-llmapi-fp8.yaml")]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    subprocess.run(argv + ["--until", "export", "--json"], check=True, capture_output=True)
    return next((work / "artifacts" / "export").glob("*/hf"))


def run(model, prompts, tokens: int, concurrency: int, spec: dict, model_dir=None) -> dict:
    """``model_dir``: the target's checkpoint (MTP reads its MTP layer from there)."""
    from trtpipe.serving.config import replace_knobs, twin_default
    from trtpipe.serving.api import Request
    from trtpipe.serving.executor import Executor
    from trtpipe.serving.reference_engine import ReferenceEngine, draft_engine

    config = replace_knobs(twin_default(512, max_batch_size=8), enable_kv_cache_reuse=False, **spec)
    ex = Executor(config, ReferenceEngine(model), threads=1, draft_engine=draft_engine(config, model, model_dir))
    done, lock, results = threading.Semaphore(0), threading.Lock(), []
    queue = list(prompts)

    def submit():
        p = queue.pop(0)
        ex.submit(Request(p, tokens, return_perf_metrics=True, exclude_input_from_output=True), finished)

    def finished(resp):
        with lock:
            results.append(resp)
            if queue:
                submit()
        done.release()

    t0 = time.perf_counter()
    with lock:
        for _ in range(min(concurrency, len(queue))):
            submit()
    for _ in prompts:
        done.acquire()
    wall = time.perf_counter() - t0
    ex.shutdown()
    errors = [r.error for r in results if r.has_error]
    if errors:
        raise RuntimeError(errors[0])
    out_tokens = sum(r.num_output_tokens for r in results)
    forwards = sum(r.perf.last_iter - r.perf.first_iter + 1 for r in results)
    itl = [(r.perf.last_token_ns - r.perf.first_token_ns) / 1e9 / (r.num_output_tokens - 1) for r in results]
    drafts = sum(r.perf.total_draft_tokens for r in results)
    accepted = sum(r.perf.total_accepted_draft_tokens for r in results)
    return {
        "tokens_per_target_forward": out_tokens / forwards,
        "acceptance_rate": accepted / drafts if drafts else None,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "output_tok_s": out_tokens / wall,
        "output_tokens": out_tokens,
        "draft_tokens": drafts,
        "accepted_draft_tokens": accepted,
        "wall_s": wall,
    }


def print_table(rows: list[dict]) -> None:
    """The markdown table of docs/results/speculative.md: each workload and concurrency off and on, ratios to off."""
    print(
        "| workload | C | spec | tokens / target forward | acceptance | ITL p50 ms | output tok/s | ITL ratio | tok/s ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for side in ("off", "on"):
            m = r[side]
            acc = "–" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.3f}"
            ratio_itl = m["itl_p50_ms"] / r["off"]["itl_p50_ms"]
            ratio_tps = m["output_tok_s"] / r["off"]["output_tok_s"]
            print(
                f"| {r['workload']} | {r['concurrency']} | {side} | {m['tokens_per_target_forward']:.2f} | {acc} | "
                f"{m['itl_p50_ms']:.2f} | {m['output_tok_s']:.0f} | {ratio_itl:.2f} | {ratio_tps:.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    model = load_hf_checkpoint(STORIES)
    tmp = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    drafts = {"draft-int4": int4_draft(tmp / "int4"), "draft-2layer": shrunk_draft(tmp / "draft-2l")}

    def ids(texts):
        return [tok.encode(texts[i % len(texts)]) for i in range(args.requests)]

    workloads = {
        "ngram": (
            ids([f"{s} {s} {s} {' '.join(s.split()[:2])}" for s in REPEATED]),
            {"speculative_decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2},
        ),
        **{
            name: (
                ids(OPENINGS),
                {"speculative_decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model": str(path)},
            )
            for name, path in drafts.items()
        },
    }
    rows = []
    for name, (prompts, spec) in workloads.items():
        for c in (1, 8):
            base = run(model, prompts, args.tokens, c, {})
            with_spec = run(model, prompts, args.tokens, c, spec)
            rows.append({"workload": name, "concurrency": c, "off": base, "on": with_spec})
    shutil.rmtree(tmp)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
