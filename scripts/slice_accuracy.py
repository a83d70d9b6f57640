#!/usr/bin/env python
"""Accuracy slice by slice: what the aggregate gate hides, and what calibrating on mixed slices changes.

For each family (stories260k, synthetic Qwen3) x algorithm x calibration set, one recipe is built through the
real stages (``trtpipe build --until verify``: calibrate, quantize, verify) with ``accuracy.slices`` prose, code and
arithmetic (the built-in sets' held-out parts) beside the aggregate (``eval_data: self``, the model's own samples,
trtpipe's default). Calibration is either the default (``dataset: self``) or ``mix`` of self, prose, code and
arithmetic with equal weights (their calibration parts: never the evaluated documents).

The gate applied to every row is the same limit on the aggregate and on each slice (``--max-kl``,
``--min-top1``): a row that passes the aggregate but fails a slice is the trap the slices exist to catch.

    python scripts/slice_accuracy.py                     # docs/results/accuracy_slices.{md,json}
    python scripts/slice_accuracy.py --families llama --algos int4_wo --out /tmp/slices
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from accuracy_report import FAMILIES, FamilyRun, block_settings  # noqa: E402
from trtpipe.app.validation import load_recipe  # noqa: E402
from trtpipe.models.dims import read_hf_config  # noqa: E402
from trtpipe.pipeline.runner import run_build  # noqa: E402
from trtpipe.app.stage_table import STAGES  # noqa: E402

SLICES = ("prose", "code", "arithmetic")
CALIBRATIONS = {
    "self": "    dataset: self\n",
    "mixed": "    mix:\n" + "".join(f"      - {{data: {d}, weight: 1}}\n" for d in ("self",) + SLICES),
}
KV = {"fp8": "fp8"}
CALIB_SAMPLES, EVAL_SAMPLES, SEQ_LEN, BATCH = 32, 16, 64, 8


def qwen3_with_tokenizer(out: Path) -> Path:
    """A synthetic Qwen3 (Qwen3-4B ratios, random weights) that can read the built-in sets: stories260k's
    byte-fallback BPE tokenizer (it encodes any text) with Qwen3's chat markers and Qwen/Qwen3-0.6B's chat
    template (tests/export/data/qwen3_chat_template.jinja), so the chat slice renders as Qwen3 renders it."""
    from transformers import AutoTokenizer

    from trtpipe.models.synthetic import make_synthetic

    tok = AutoTokenizer.from_pretrained(str(ROOT / "models" / "stories260k"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = (ROOT / "tests" / "export" / "data" / "qwen3_chat_template.jinja").read_text()
    make_synthetic("qwen3", out, seed=0, vocab_size=len(tok))
    tok.save_pretrained(str(out))
    return out


def recipe_text(name: str, run: FamilyRun, algo: str, calibration: str) -> str:
    group, extra = block_settings(read_hf_config(run.hf), algo)
    names = SLICES + (("chat",) if run.family == "qwen3" else ())  # stories260k has no chat template
    slices = "".join(f"    - {{name: {s}, data: {s}}}\n" for s in names)
    return (
        f"name: {name}\nwork_dir: work\ntarget: engine\nmodel:\n  source: {run.hf}\n  dtype: {run.dtype}\n"
        f"quantization:\n  algo: {algo}\n  kv_cache: {KV.get(algo, 'none')}\n  group_size: {group}\n"
        f"  exclude: {json.dumps(['*lm_head'] + extra)}\n  calibration:\n{CALIBRATIONS[calibration]}"
        f"    num_samples: {CALIB_SAMPLES}\n    seq_len: {SEQ_LEN}\n    batch_size: {BATCH}\n    device: cpu\n"
        f"accuracy:\n  num_samples: {EVAL_SAMPLES}\n  seq_len: {SEQ_LEN}\n  slices:\n{slices}"
    )


def one(run: FamilyRun, algo: str, calibration: str) -> dict:
    path = run.work / f"{algo}-{calibration}.yaml"  # one work dir per family: checkpoint built once
    path.write_text(recipe_text(f"{run.family}-{algo}-{calibration}", run, algo, calibration))
    start = time.perf_counter()
    result = run_build(load_recipe(path), STAGES, until="verify", quiet=True)
    doc = json.loads((result.artifact("verify") / "accuracy.json").read_text())
    row = {"family": run.family, "algo": algo, "calibration": calibration, "seconds": 0.0}
    row["aggregate"] = doc["rows"][1]
    row["slices"] = {name: s["rows"][1] for name, s in doc["slices"].items()}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def verdict(row: dict, max_kl: float, min_top1: float) -> str:
    def bad(r):
        return r["kl_divergence"] > max_kl or r["top1_agreement"] < min_top1

    failed = [name for name, r in row["slices"].items() if bad(r)]
    agg = "FAIL" if bad(row["aggregate"]) else "pass"
    return f"aggregate {agg}" + (f"; slices FAIL: {', '.join(failed)}" if failed else "; slices pass")


def table(rows: list[dict], max_kl: float, min_top1: float) -> str:
    cols = ["aggregate (self)"] + list(SLICES) + ["chat"]
    head = "| family | algo | calibration | " + " | ".join(f"{c} KL / top-1" for c in cols) + " | gate |"
    lines = [head, "|" + "---|" * 3 + "---:|" * len(cols) + "---|"]
    for r in rows:
        cells = [r["aggregate"]] + [r["slices"].get(s) for s in SLICES + ("chat",)]
        nums = " | ".join(  # KL rounding a hair below 0 (float32 log-softmax) is shown as 0
            "-" if c is None else f"{max(c['kl_divergence'], 0.0):.4f} / {c['top1_agreement']:.3f}" for c in cells
        )
        lines.append(f"| {r['family']} | {r['algo']} | {r['calibration']} | {nums} | {verdict(r, max_kl, min_top1)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["llama", "qwen3"], choices=list(FAMILIES))
    ap.add_argument("--algos", nargs="+", default=["int4_wo", "int4_awq", "int8_sq", "fp8"])
    ap.add_argument("--calibrations", nargs="+", default=list(CALIBRATIONS), choices=list(CALIBRATIONS))
    ap.add_argument("--max-kl", type=float, default=0.05, help="The gate's KL limit, aggregate and every slice.")
    ap.add_argument("--min-top1", type=float, default=0.9, help="The gate's top-1 limit, aggregate and slices.")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--table-from", nargs="+", type=Path, help="Only write the table of these earlier JSON results.")
    args = ap.parse_args()
    rows = [r for p in args.table_from or [] for r in json.loads(p.read_text())]
    with tempfile.TemporaryDirectory(prefix="trtpipe-slices-") as tmp:
        for family in [] if args.table_from else args.families:
            run = FamilyRun(family, Path(tmp) / family)
            if family == "qwen3":
                run.hf = qwen3_with_tokenizer(Path(tmp) / family / "hf-tok")
            for algo in args.algos:
                for cal in args.calibrations:
                    rows.append(one(run, algo, cal))
                    print(table(rows[-1:], args.max_kl, args.min_top1).splitlines()[-1], flush=True)
    text = table(rows, args.max_kl, args.min_top1)
    cmd = "python scripts/slice_accuracy.py " + " ".join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy_slices.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "accuracy_slices.md").write_text(
        f"# Accuracy slice by slice\n\n`{cmd.strip()}` on {platform.machine()}, "
        f"{time.strftime('%Y-%m-%d')}; {sum(r['seconds'] for r in rows):.0f} s of builds. Gate on every row: KL <= "
        f"{args.max_kl} and top-1 >= {args.min_top1}, on the aggregate and on each slice. Deployed configuration "
        f"rows (KV quantized where the algorithm's row says so). {CALIB_SAMPLES} calibration and {EVAL_SAMPLES} "
        f"evaluation samples of {SEQ_LEN} tokens per set.\n\n{text}\n"
    )
    print(text)


if __name__ == "__main__":
    main()
