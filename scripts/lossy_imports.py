#!/usr/bin/env python
"""What each lossy step of a pre-quantized engine conversion (``model.allow_lossy_import``) costs, measured.

For each producer checkpoint that needs a step (tests/prequantized.py builds them with the real producers:
ModelOpt and llm-compressor FP8 of stories260k, whose fused q/k/v and gate/up members have different weight
scales; AutoAWQ GEMM, asymmetric GPTQ and compressed-tensors asymmetric W4A16, zero-point INT4) the source as
stored (the reference runtime's loader of the source's own format, every projection dequantized as its producer
defines it) is compared with the TensorRT-LLM checkpoint the engine target writes (``convert`` with only that
step accepted, run by the same reference runtime, the CPU twin's executor), at the model dtype ``auto`` gives and at
float32: for FP8 the float32 row is the step alone (ModelOpt's stories export keeps float32 embeddings and norms,
which ``auto`` rounds to float16), for zero points it is the exact control (float32 summation order only).

Data: the accuracy report's (scripts/accuracy_report.py): ``EVAL_SAMPLES`` samples of ``SEQ_LEN`` tokens the
source draws from BOS with seed ``SEED + EVAL_SEED_OFFSET``. Per row: KL(source || converted) per token (mean and
max), top-1 agreement, the largest logit change relative to the token's largest source logit, and for
fp8_requantize the weights: elements requantized and the largest change as a share of one FP8 rounding's bound
(2^-4 of the larger magnitude + 2^-10 of the shared scale; <= 1 by construction of E4M3).

    python scripts/lossy_imports.py          # docs/results/lossy_imports.{md,json}
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "tests")]

from accuracy_report import EVAL_SAMPLES, SEED, SEQ_LEN, self_tokens  # noqa: E402
from prequantized import prequantized  # noqa: E402
from trtpipe.checkpoint.convert import convert  # noqa: E402
from trtpipe.quant.imported.detect import detect  # noqa: E402
from trtpipe.quant.imported.lossy import FP8_REQUANTIZE, FP8_UNIT_ROUNDOFF, ZERO_POINT_ROUNDING  # noqa: E402
from trtpipe.quant.imported.trtllm import ImportedLinears  # noqa: E402
from trtpipe.stages.quant import EVAL_SEED_OFFSET  # noqa: E402
from trtpipe.runtime import load_checkpoint  # noqa: E402
from trtpipe.runtime.hf_loader import load_hf_checkpoint  # noqa: E402

# (fixture, step accepted, model dtype)
CASES = [
    ("modelopt-fp8-stories", FP8_REQUANTIZE, "auto"),
    ("modelopt-fp8-stories", FP8_REQUANTIZE, "float32"),  # its float32 embedding/norms kept: the step alone
    ("llmc-fp8_static-stories", FP8_REQUANTIZE, "auto"),
    ("gptqmodel-awq_gemm-qwen3", ZERO_POINT_ROUNDING, "auto"),
    ("gptqmodel-awq_gemm-qwen3", None, "float32"),
    ("gptqmodel-gptq_v1_asym-qwen3", ZERO_POINT_ROUNDING, "auto"),
    ("gptqmodel-gptq_v1_asym-qwen3", None, "float32"),
    ("llmc-w4a16_asym-stories", ZERO_POINT_ROUNDING, "auto"),
    ("llmc-w4a16_asym-stories", None, "float32"),
]
FUSED = (("attention", "qkv"), ("mlp", "fc"), ("mlp", "gate"))
BATCH = 8


def _weight(m) -> torch.Tensor:
    return torch.cat([p.weight for p in m.parts]) if hasattr(m, "parts") else m.weight


def fp8_weights(src_model, conv_model) -> dict:
    """Requantized elements of the fused FP8 linears and the largest change as a share of one FP8 rounding."""
    changed, total, share = 0, 0, 0.0
    for a_layer, b_layer in zip(conv_model.layers, src_model.layers):
        for owner, attr in FUSED:
            a = _weight(getattr(getattr(a_layer, owner)[0], attr)).float()
            b = _weight(getattr(getattr(b_layer, owner)[0], attr)).float()
            s = float(a.abs().max()) / 448  # the shared scale: the member with the largest amax keeps +-448
            bound = FP8_UNIT_ROUNDOFF * torch.maximum(a.abs(), b.abs()) + 2.0**-10 * s
            changed += int((a != b).sum())
            total += a.numel()
            share = max(share, float(((a - b).abs() / bound).max()))
    return {"requantized_elements": changed, "fused_elements": total, "max_share_of_fp8_rounding_bound": share}


def logit_metrics(src_model, conv_model, tokens: torch.Tensor) -> dict:
    with torch.no_grad():
        ref = torch.cat([src_model(tokens[i : i + BATCH]) for i in range(0, len(tokens), BATCH)]).double()
        got = torch.cat([conv_model(tokens[i : i + BATCH]) for i in range(0, len(tokens), BATCH)]).double()
    ref_logp, logp = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
        "max_rel_logit_change": float(rel.max()),
    }


def one(name: str, step, dtype: str, work: Path) -> dict:
    src = prequantized(name)
    fmt = detect(src)
    start = time.perf_counter()
    src_model = load_hf_checkpoint(src)
    tokens = self_tokens(src_model, EVAL_SAMPLES, SEED + EVAL_SEED_OFFSET)
    allowed = (step,) if step else ()
    out = convert(
        src,
        work / f"{name}-{dtype}",
        dtype=dtype,
        overwrite=True,
        importer=lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), allowed),
    )
    conv_dtype = json.loads((out / "config.json").read_text())["dtype"]
    conv_model = load_checkpoint(out)
    row = {
        "fixture": name,
        "format": fmt.describe().split(" from ")[0],
        "step": step or "none (exact)",
        "dtype": conv_dtype,
        **logit_metrics(src_model, conv_model, tokens),
    }
    if step == FP8_REQUANTIZE:
        row.update(fp8_weights(src_model, conv_model))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def fmt_rows(rows: list[dict]) -> str:
    head = (
        "| source | step | dtype | KL mean (nats/token) | KL max | top-1 | max rel. logit change | "
        "FP8 weights requantized (share of bound) |\n|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        w = (
            f"{r['requantized_elements']}/{r['fused_elements']} ({r['max_share_of_fp8_rounding_bound']:.2f})"
            if "requantized_elements" in r
            else "-"
        )
        body += (
            f"| {r['fixture']} | {r['step']} | {r['dtype']} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | "
            f"{r['top1_agreement']:.4f} | {r['max_rel_logit_change']:.2e} | {w} |\n"
        )
    return head + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="directory of the .md and .json")
    args = ap.parse_args()
    torch.manual_seed(SEED)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    cmd = "python scripts/lossy_imports.py"
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lossy_imports_") as tmp:
        for name, step, dtype in CASES:
            rows.append(one(name, step, dtype, Path(tmp)))
            r = rows[-1]
            print(
                f"{name:<30} {r['step']:<20} {r['dtype']:<9} KL {r['kl_mean']:.2e} top-1 {r['top1_agreement']:.4f} "
                f"rel {r['max_rel_logit_change']:.2e}",
                flush=True,
            )
    seconds = round(time.perf_counter() - start, 1)
    meta = {
        "command": cmd,
        "commit": commit,
        "seconds": seconds,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "eval": {
            "dataset": "self (the source's own samples from BOS)",
            "num_samples": EVAL_SAMPLES,
            "seq_len": SEQ_LEN,
            "seed": SEED + EVAL_SEED_OFFSET,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lossy_imports.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    md = [
        "# Lossy import conversions: the source as stored vs its engine checkpoint\n",
        f"Made by `{cmd}` at commit {commit} ({seconds:.0f} s, {meta['torch_threads']} torch threads). Each "
        "producer checkpoint (tests/prequantized.py) run as stored by the reference runtime against the "
        "TensorRT-LLM checkpoint the engine target writes with only that step accepted "
        "(`model.allow_lossy_import`), run by the same runtime. Data: the accuracy report's held-out scheme, "
        f"{EVAL_SAMPLES} samples x {SEQ_LEN} tokens the source draws from BOS (seed {SEED + EVAL_SEED_OFFSET}). "
        "KL(source || converted) per token; max rel. logit change: the largest |logit change| of a token over "
        "its largest |source logit|. float32 rows: zero points are exact there (nothing to accept), what is "
        "left is float32 summation order. The qwen3 fixtures are random-init (their logits nearly one-hot); "
        "stories260k is trained.\n",
        fmt_rows(rows),
        "",
    ]
    (args.out / "lossy_imports.md").write_text("\n".join(md))
    print(f"wrote {args.out / 'lossy_imports.md'} and .json ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
