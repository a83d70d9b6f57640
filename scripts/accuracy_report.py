#!/usr/bin/env python
"""Accuracy per model family x quantization algorithm: perplexity unquantized vs quantized, KL(unquantized ||
quantized), top-1 agreement, on the reference runtime.

Families: Llama (the real stories260k in models/stories260k) and synthetic Qwen3, Qwen3-MoE, Gemma 3 and gpt-oss
(``trtpipe.models.synthetic``: transformers' own classes, each family's published config shrunk, random weights;
gpt-oss with its experts stored in MXFP4 as the hub checkpoints ship them, kept so by every algorithm). Algorithms: every ``quantization.algo``
of the recipe schema (fp8 with an FP8 KV cache; the others with the KV cache unquantized).

Each combination is first a recipe (``target: engine`` where the family has a TensorRT engine and the algorithm a
TensorRT-LLM checkpoint layout, else ``target: llmapi``) loaded through ``trtpipe.app.validation.load_recipe``, the
loader ``trtpipe validate`` runs: a combination it refuses is a row carrying the rule's own message. Otherwise the
recipe is built by ``trtpipe.pipeline.runner.run_build`` (what ``trtpipe build RECIPE --until STAGE`` runs; the
recipes of one family share a work dir, so the checkpoint and the calibration statistics are built once and reused
from the artifact cache):

* an algorithm with a TensorRT-LLM checkpoint layout: ``--until verify``; the row is the verify artifact's
  ``accuracy.json`` (layer by layer; the quantized model with its KV cache quantized and without);
* an llmapi-only format (fp8_pc_pt, nvfp4), for which the build has no verify stage: ``--until export``; the
  export artifact's unified HF checkpoint read back by the reference runtime's unified-HF loader, compared
  whole-model by ``trtpipe.quant.accuracy.compare`` on the verify stage's held-out samples.

Data: the unquantized model's own samples from BOS (``dataset: self``): calibration and held-out evaluation with
different seeds, as the stages draw them. The synthetic models' weights are random (drawn so their logits are well
separated): the perplexity of their own samples is close to 1 and means nothing about language; KL and top-1
agreement say how far each algorithm moves the model, between algorithms of one family.

    python scripts/accuracy_report.py                       # docs/results/accuracy_families.{md,json}, accuracy.md
    python scripts/accuracy_report.py --families qwen3 --algos fp8 nvfp4 --out /tmp/acc
    python scripts/accuracy_report.py --families qwen3_moe --algos int4_awq --update   # one row again, in place
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trtpipe.checkpoint.quant_layouts import ALGOS  # noqa: E402
from trtpipe.errors import RecipeError, TrtpipeError  # noqa: E402
from trtpipe.stages.export import HF_DIR  # noqa: E402
from trtpipe.models import get_family  # noqa: E402
from trtpipe.models.dims import read_hf_config  # noqa: E402
from trtpipe.models.synthetic import make_synthetic  # noqa: E402
from trtpipe.pipeline.runner import run_build  # noqa: E402
from trtpipe.app.stage_table import STAGES  # noqa: E402
from trtpipe.quant import accuracy  # noqa: E402
from trtpipe.quant.data import batched_decode, self_samples  # noqa: E402
from trtpipe.formats.schemes import BY_RECIPE, GROUP_SIZES  # noqa: E402
from trtpipe.quant.rules import int4_problems, linear_dims  # noqa: E402
from trtpipe.stages.quant import EVAL_SEED_OFFSET  # noqa: E402
from trtpipe.recipe.schema import QuantAlgoName  # noqa: E402
from trtpipe.runtime import load_checkpoint  # noqa: E402
from trtpipe.runtime.hf_loader import load_hf_checkpoint  # noqa: E402
from trtpipe.app.validation import load_recipe  # noqa: E402

# family -> (source: a directory under the repository or a synthetic kind, model dtype, what it is)
FAMILIES = {
    "llama": ("models/stories260k", "float16", "stories260k (trained), 5 layers"),
    "qwen3": ("qwen3", "bfloat16", "synthetic Qwen3-4B ratios, 2 layers"),
    "qwen3_moe": ("qwen3_moe", "bfloat16", "synthetic Qwen3-30B-A3B ratios, 2 layers, 8 experts top-2"),
    "gemma3": ("gemma3", "bfloat16", "synthetic gemma-3-27b ratios, 6 layers (5 sliding, 1 global)"),
    "gpt_oss": ("gpt_oss_mxfp4", "bfloat16", "synthetic gpt-oss-20b ratios, 4 layers, 8 experts top-2, MXFP4 experts"),
}
ALGOS_ALL = [a for a in QuantAlgoName.__args__ if a != "none"]
KV = {"fp8": "fp8"}  # algo -> KV cache quantization of its row (the rest: none)
GPU = {"nvfp4": "b200-180gb"}  # algo -> engine.gpu (the rest: the default H100): FP4 GEMMs need Blackwell
# recipe settings of every combination (small: the whole table runs in minutes on 2 cores)
CALIB_SAMPLES, EVAL_SAMPLES, SEQ_LEN, BATCH, SEED = 16, 8, 64, 8, 0


def block_settings(info, algo: str) -> tuple[int, list[str]]:
    """The group size and the extra ``exclude`` of a block-quantized recipe, as ``trtpipe validate``'s fix for it
    says. INT4: the group size leaving the fewest linears without whole groups (the largest of equals), those
    linears excluded (stories260k: its MLP down projection, 172 inputs; Gemma 3: o_proj, 48 inputs). NVFP4: the
    linears whose inputs are not whole 16-blocks excluded."""
    block = BY_RECIPE[algo].block if algo in BY_RECIPE else None
    if block:
        return 128, ["*" + n for n, (_, i) in linear_dims(info).items() if i % block]
    if algo not in ALGOS or ALGOS[algo].weight_fmt != "int4":
        return 128, []
    remaining = {g: sorted(int4_problems(info, 1, g)) for g in GROUP_SIZES}
    best = min(GROUP_SIZES, key=lambda g: (len(remaining[g]), -g))
    return best, ["*" + n for n in remaining[best]]


def target(family: str, algo: str, hf_dir: Path) -> str:
    fam = get_family(read_hf_config(hf_dir).architecture)
    return "engine" if not fam.no_engine and algo in ALGOS else "llmapi"


def recipe_text(
    name: str, hf_dir: Path, dtype: str, algo: str, kv: str, group: int, exclude: list[str], tgt: str
) -> str:
    gpu = f"engine:\n  gpu: {GPU[algo]}\n" if algo in GPU else ""
    return (
        f"name: {name}\nwork_dir: work\ntarget: {tgt}\n{gpu}model:\n  source: {hf_dir}\n  dtype: {dtype}\n"
        f"quantization:\n  algo: {algo}\n  kv_cache: {kv}\n  group_size: {group}\n"
        f"  exclude: {json.dumps(exclude)}\n  calibration:\n"
        f"    dataset: self\n    num_samples: {CALIB_SAMPLES}\n    seq_len: {SEQ_LEN}\n    batch_size: {BATCH}\n"
        f"    device: cpu\naccuracy:\n  num_samples: {EVAL_SAMPLES}\n  seq_len: {SEQ_LEN}\n"
    )


def self_tokens(model, n: int, seed: int) -> torch.Tensor:
    """[n, SEQ_LEN] samples of ``model`` from BOS (token 1), as ``dataset: self`` draws them."""
    gen = lambda prompts, k, _: batched_decode(model, torch.tensor(prompts), k, 1.0, seed).tolist()  # noqa: E731
    return self_samples(gen, 1, n, SEQ_LEN)


class FamilyRun:
    """One family's source model and work folder; its recipes share one work dir (one artifact cache)."""

    def __init__(self, family: str, work: Path):
        src, self.dtype, self.what = FAMILIES[family]
        self.family, self.work = family, work
        work.mkdir(parents=True, exist_ok=True)
        self.hf = ROOT / src if "/" in src else make_synthetic(src, work / "hf", seed=SEED)
        self._heldout: torch.Tensor | None = None

    def heldout(self, base: Path) -> torch.Tensor:
        """The verify stage's held-out samples (``dataset: self``) of the unquantized checkpoint ``base``."""
        if self._heldout is None:
            self._heldout = self_tokens(load_checkpoint(base), EVAL_SAMPLES, SEED + EVAL_SEED_OFFSET)
        return self._heldout


def measure(run: FamilyRun, recipe) -> tuple[str, list[dict]]:
    """Build the recipe through the real stages up to what measures it; the rows its accuracy report holds."""
    result = run_build(recipe, STAGES, until="verify", quiet=True)
    if result.stage("verify")["status"] in ("ran", "cached"):
        rows = json.loads((result.artifact("verify") / "accuracy.json").read_text())["rows"]
        return "TensorRT-LLM checkpoint (verify stage)", rows
    base = result.artifact("checkpoint")
    quantized = load_hf_checkpoint(result.artifact("export") / HF_DIR)
    rows = accuracy.compare(load_checkpoint(base), {"quantized": quantized}, run.heldout(base), batch=BATCH)
    return "unified HF export (llmapi)", [r.__dict__ for r in rows]


def one(run: FamilyRun, algo: str) -> dict:
    kv = KV.get(algo, "none")
    int4 = algo in ALGOS and ALGOS[algo].weight_fmt == "int4"
    group, extra = block_settings(read_hf_config(run.hf), algo)
    tgt = target(run.family, algo, run.hf)
    row = {
        "family": run.family,
        "model": run.what,
        "algo": algo,
        "kv_cache": kv,
        "target": tgt,
        "group_size": group if int4 else None,
        "exclude": ["*lm_head"] + extra,
        "family_kept_unquantized": list(get_family(read_hf_config(run.hf).architecture).kept_unquantized),
    }
    path = run.work / f"{algo}.yaml"  # beside the others of this family: ``work_dir: work`` is one cache
    path.write_text(recipe_text(f"{run.family}-{algo}", run.hf, run.dtype, algo, kv, group, row["exclude"], tgt))
    try:
        recipe = load_recipe(path)
    except RecipeError as exc:
        # the synthetic model lives in a temporary directory: name it as the table does, not by its path
        row["refused"] = "; ".join(f"{p.key}: {p.message}" for p in exc.problems).replace(
            str(run.hf), f"<synthetic {run.family}>"
        )
        return row
    start = time.perf_counter()
    try:
        row["measured_on"], row["rows"] = measure(run, recipe)
    except TrtpipeError as exc:  # validated but refused while building: the report says so, the table goes on
        row["refused"] = f"(at build) {exc}"
        return row
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def fmt_rows(results: list[dict]) -> str:
    head = (
        "| family | algo | KV | target | ppl unquantized | ppl quantized | ppl +% | KL(unq ‖ q) | top-1 | "
        "greedy match /32 | kept unquantized |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in results:
        if "refused" in r:
            lines.append(
                f"| {r['family']} | {r['algo']} | {r['kv_cache']} | {r['target']} | "
                f"refused: {r['refused'].replace('|', '/')} |||||||"
            )
            continue
        ref, q = r["rows"][0], r["rows"][1]  # the deployed configuration: KV quantized when the row says so
        greedy = "-" if q["greedy_match_len"] is None else f"{q['greedy_match_len']:.1f}"
        lines.append(
            f"| {r['family']} | {r['algo']} | {r['kv_cache']} | {r['target']} | {ref['perplexity']:.4f} | "
            f"{q['perplexity']:.4f} | {q['ppl_increase_pct']:+.3f} | {q['kl_divergence']:.2e} | "
            f"{q['top1_agreement']:.4f} | {greedy} | {', '.join(f'`{e}`' for e in r['exclude'] + r['family_kept_unquantized'])} |"
        )
    return "\n".join(lines)


def kl_matrix(results: list[dict]) -> str:
    """family x algo: KL(unquantized || quantized) of the deployed configuration, or 'refused' (docs/results/accuracy.md's excerpt)."""
    algos = list(dict.fromkeys(r["algo"] for r in results))
    by = {(r["family"], r["algo"]): r for r in results}
    lines = [
        "| family | " + " | ".join(f"{a}{' + KV ' + KV[a] if a in KV else ''}" for a in algos) + " |",
        "|---|" + "---:|" * len(algos),
    ]
    for family in dict.fromkeys(r["family"] for r in results):
        cells = []
        for a in algos:
            r = by.get((family, a))
            cells.append("" if r is None else "refused" if "refused" in r else f"{r['rows'][1]['kl_divergence']:.2e}")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


EXCERPT_BEGIN, EXCERPT_END = "<!-- accuracy-families:begin -->", "<!-- accuracy-families:end -->"


def rewrite_excerpt(page: Path, made: str, results: list[dict]) -> None:
    """The excerpt between the markers of ``page`` (docs/results/accuracy.md, beside accuracy_families.md): the
    KL matrix and the commands that made it."""
    text = page.read_text()
    if text.count(EXCERPT_BEGIN) != 1 or text.count(EXCERPT_END) != 1:
        raise SystemExit(f"{page}: needs exactly one '{EXCERPT_BEGIN}' and one '{EXCERPT_END}' line")
    head, rest = text.split(EXCERPT_BEGIN)
    _, tail = rest.split(EXCERPT_END)
    body = (
        f"Made by {made} ([accuracy_families.md](accuracy_families.md): perplexity, "
        f"top-1, greedy match and each refusal's reason). KL(unquantized ‖ quantized) per token:\n\n"
        f"{kl_matrix(results)}\n"
    )
    page.write_text(f"{head}{EXCERPT_BEGIN}\n{body}{EXCERPT_END}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--algos", nargs="+", default=ALGOS_ALL, choices=ALGOS_ALL)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results", help="directory of the .md and .json")
    ap.add_argument(
        "--update",
        action="store_true",
        help="replace only these rows of the existing JSON (e.g. after "
        "trtpipe learns a refused combination), keep the others, rewrite the table",
    )
    args = ap.parse_args()
    torch.manual_seed(SEED)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    cmd = (
        "python scripts/accuracy_report.py"
        + "".join(
            f" --{k} {' '.join(v)}"
            for k, v in (("families", args.families), ("algos", args.algos))
            if v != (list(FAMILIES) if k == "families" else ALGOS_ALL)
        )
        + (" --update" if args.update else "")
    )
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="accuracy_report_") as tmp:
        for family in args.families:
            run = FamilyRun(family, Path(tmp) / family)
            for algo in args.algos:
                r = {**one(run, algo), "command": cmd, "commit": commit}
                results.append(r)
                what = r.get("refused") or f"KL {r['rows'][1]['kl_divergence']:.2e} ({r['seconds']} s)"
                print(f"{family:<10} {algo:<10} {what}", flush=True)
    seconds = round(time.perf_counter() - start, 1)
    path = args.out / "accuracy_families.json"
    runs = [
        {
            "command": cmd,
            "commit": commit,
            "seconds": seconds,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(),
        }
    ]
    if args.update:
        old = json.loads(path.read_text())
        new = {(r["family"], r["algo"]) for r in results}
        order = {(f, a): i for i, (f, a) in enumerate((f, a) for f in FAMILIES for a in ALGOS_ALL)}
        results = sorted(
            [r for r in old["results"] if (r["family"], r["algo"]) not in new] + results,
            key=lambda r: order[(r["family"], r["algo"])],
        )
        runs = old["runs"] + runs
    meta = {
        "runs": runs,
        "calibration": {"dataset": "self", "num_samples": CALIB_SAMPLES, "seq_len": SEQ_LEN, "seed": SEED},
        "heldout": {
            "dataset": "self",
            "num_samples": EVAL_SAMPLES,
            "seq_len": SEQ_LEN,
            "seed": SEED + EVAL_SEED_OFFSET,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    made = "; then ".join(
        f"`{r['command']}` at commit {r['commit']} ({r['seconds']:.0f} s, {r['torch_threads']} torch threads)"
        for r in runs
    )
    md = [
        "# Accuracy per family x algorithm\n",
        f"Made by {made}; each row of accuracy_families.json names the run that made it. "
        f"Held-out data: {EVAL_SAMPLES} samples x {SEQ_LEN} tokens each model draws from BOS (seed "
        f"{SEED + EVAL_SEED_OFFSET}); calibration: {CALIB_SAMPLES} x {SEQ_LEN} (seed {SEED}). The quantized "
        "row is the deployed configuration (KV cache quantized when the KV column says so); "
        "accuracy_families.json also has the KV-unquantized row.\n",
        "Only stories260k is a trained model. The others are random-init (their published configs shrunk), with "
        "weights drawn so their logits are well separated (trtpipe/models/synthetic.py): their next-token "
        "distribution is nearly one-hot, so the perplexity of their own samples is close to 1 and says nothing of "
        "language; KL(unquantized ‖ quantized) and top-1 agreement are the figures to compare, between algorithms "
        "of one family (their absolute size depends on how peaked the random model is). Refused rows carry the "
        "message `trtpipe validate` prints for that recipe; rerun them (`--families F --algos A --update`) when "
        "trtpipe supports them.\n",
        fmt_rows(results),
        "",
    ]
    (args.out / "accuracy_families.md").write_text("\n".join(md))
    if args.out.resolve() == (ROOT / "docs" / "results").resolve():
        rewrite_excerpt(args.out / "accuracy.md", made, results)
    print(f"wrote {args.out / 'accuracy_families.md'} and .json ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
