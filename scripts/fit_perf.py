#!/usr/bin/env python
"""Fit the step-cost model's named constants on NVIDIA's published TensorRT-LLM numbers and cross-validate.

    python scripts/fit_perf.py [--data trtpipe/perf/data/published_trtllm.csv]
                               [--out-constants trtpipe/perf/constants.json]
                               [--plot docs/results/perf_cv.png] [--table docs/results/perf_fit.md]

Two constant sets are fitted (same names, same model): ``engine`` (TensorRT engines, 0.5-0.17: max-load,
static batch, batch-1 latency rows) and ``pytorch`` (the PyTorch backend, 0.19+: max-load rows). Errors are
|pred / published - 1| per regime, in-sample (fit on everything) and leave-one-GPU-out (fit without a GPU's rows,
predict them). Deterministic: no random numbers anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

from trtpipe.perf import fit as F
from trtpipe.errors import TrtpipeError
from trtpipe.perf.models import published_spec
from trtpipe.perf.published import PUBLISHED_CSV, read_rows, regime, to_published_unit

ROOT = Path(__file__).resolve().parents[1]
TRAIN_REGIMES = {
    "engine": ("engine max-load", "static batch", "batch-1 TTFT", "batch-1 ITL"),
    "pytorch": ("pytorch max-load",),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument(
        "--data",
        type=Path,
        default=PUBLISHED_CSV,
        help="the published numbers (default: the copy in trtpipe/perf/data/, sources in SOURCES.md)",
    )
    ap.add_argument("--out-constants", type=Path, default=F.CONSTANTS_FILE)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "results" / "perf_cv.png")
    ap.add_argument("--table", type=Path, default=ROOT / "docs" / "results" / "perf_fit.md")
    ap.add_argument(
        "--worst",
        type=Path,
        default=ROOT / "docs" / "results" / "perf_worst.md",
        help="the ten worst leave-one-GPU-out PyTorch-backend rows, with what bounds them",
    )
    ap.add_argument("--no-cv", action="store_true", help="fit only")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="explore: the PyTorch backend only, other_gb fixed at 2.0 (its fitted value), nothing "
        "written; the committed numbers come from the full run",
    )
    a = ap.parse_args(argv)

    rows = read_rows(a.data)
    regs = np.array([regime(r) for r in rows])
    fams = np.array([F.family(r) for r in rows])
    gpus = np.array([r["gpu"] for r in rows])
    moe = np.array([_is_moe(r) for r in rows])
    worst: list[str] = []
    compiled = [F.compile_rows(rows, g) for g in ((2.0,) if a.quick else F.OTHER_GB_GRID)]
    ok = compiled[0].ok
    constants, in_sample, cv, cv_pred = {}, {}, {}, np.full(len(rows), np.nan)
    families = {"pytorch": TRAIN_REGIMES["pytorch"]} if a.quick else TRAIN_REGIMES
    for fam, regimes in families.items():
        train = ok & (fams == fam) & np.isin(regs, regimes)
        c, comp = F.fit_all(compiled, train, fam)
        constants[fam] = c
        pred = F.predict(comp, c)
        for reg in regimes:
            in_sample[reg] = F.summary(F.abs_rel_errors(comp, train & (regs == reg), pred))
        if a.no_cv:
            continue
        for g in sorted(set(gpus[train])):
            c_g, comp_g = F.fit_all(compiled, train & (gpus != g), fam)
            p = F.predict(comp_g, c_g)
            held = train & (gpus == g)
            cv_pred[held] = p[held]
            print(f"  [{fam}] without {g}: {F.summary(F.abs_rel_errors(comp_g, held, p))}", file=sys.stderr)
        for reg in regimes:
            cv[reg] = F.summary(F.abs_rel_errors(compiled[0], train & (regs == reg), cv_pred))
            cv[reg]["gpus"] = sorted(set(gpus[train & (regs == reg)]))
        if fam == "pytorch":  # the same table per model family: dense and MoE
            for kind, is_moe in (("dense", False), ("MoE", True)):
                sub = train & (moe == is_moe)
                in_sample[f"pytorch max-load, {kind}"] = F.summary(F.abs_rel_errors(comp, sub, pred))
                if not a.no_cv:
                    cv[f"pytorch max-load, {kind}"] = F.summary(F.abs_rel_errors(compiled[0], sub, cv_pred))
                    cv[f"pytorch max-load, {kind}"]["gpus"] = sorted(set(gpus[sub]))
            # the same figures without the H200 rows (added 2026-12-05), so runs before and after compare
            old = train & ~np.char.startswith(gpus.astype(str), "H200")
            for kind, sub in (("", old), (", MoE", old & moe)):
                name = f"pytorch max-load{kind}, without H200 rows"
                in_sample[name] = F.summary(F.abs_rel_errors(comp, sub, pred))
                if not a.no_cv:
                    cv[name] = F.summary(F.abs_rel_errors(compiled[0], sub, cv_pred))
                    cv[name]["gpus"] = sorted(set(gpus[sub]))
            if not a.no_cv:
                worst = worst_rows(rows, compiled[0], cv_pred, train, 10)

    if a.quick:
        print(
            json.dumps(
                {
                    "constants": {k: asdict(v) for k, v in constants.items()},
                    "in_sample": in_sample,
                    "leave_one_gpu_out": cv,
                },
                indent=1,
            )
        )
        return 0
    a.out_constants.write_text(
        json.dumps(
            {
                "source": "scripts/fit_perf.py on NVIDIA's published TensorRT-LLM performance tables",
                "constants": {k: asdict(v) for k, v in constants.items()},
                "in_sample": in_sample,
                "leave_one_gpu_out": cv,
            },
            indent=2,
        )
        + "\n"
    )
    lines = [
        "| regime | rows | in-sample median | in-sample p90 | LOGO median | LOGO p90 | GPUs held out in turn |",
        "|---|---|---|---|---|---|---|",
    ]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for reg, s in in_sample.items():
        v = cv.get(reg, {})
        lines.append(
            f"| {reg} | {s['n']} | {pct(s['median'])} | {pct(s['p90'])} | {pct(v.get('median'))} | "
            f"{pct(v.get('p90'))} | {', '.join(v.get('gpus', []))} |"
        )
    lines.append("")
    lines.append("| constant | " + " | ".join(constants) + " |")
    lines.append("|---|" + "---|" * len(constants))
    for name in F.Constants.names():
        lines.append(f"| {name} | " + " | ".join(f"{getattr(c, name):.4g}" for c in constants.values()) + " |")
    a.table.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if worst:
        a.worst.write_text("\n".join(worst) + "\n")
        print("\n".join(worst))
    if not a.no_cv:
        kinds = np.array(
            [f"{reg}, {'MoE' if m else 'dense'}" if reg == "pytorch max-load" else reg for reg, m in zip(regs, moe)]
        )
        _plot(a.plot, compiled[0].published, cv_pred, kinds)
    return 0


def _is_moe(row: dict) -> bool:
    try:
        return published_spec(row["model"]).is_moe
    except TrtpipeError:
        return False


def worst_rows(rows, comp, pred: np.ndarray, mask: np.ndarray, k: int) -> list[str]:
    """The ``k`` rows predicted worst (leave-one-GPU-out), with what the model says bounds them: the batch (slots,
    KV capacity, token budget) and the step's dominant term at the median KV length, under the held-out fit."""
    err = np.where(mask, np.abs(pred / comp.published - 1), -1.0)
    err[~np.isfinite(err)] = -1.0
    out = [
        "| model | GPU | layout | version | ISL/OSL | published | predicted (LOGO) | ratio | batch bound | "
        "step bound (share) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i in np.argsort(-err)[:k]:
        r, case = rows[i], comp.cases[i]
        t = case.parts[len(case.parts) // 2][1]  # the middle Simpson step: median KV length
        raw = {
            "weights": t.mem,
            "KV reads": t.kv,
            "GEMM": t.gemm - t.expert_gemm,
            "expert GEMM": t.expert_gemm,
            "attention": t.attn,
            "link": t.comm,
        }
        top = max(raw, key=raw.get)
        share = raw[top] / max(sum(raw.values()), 1e-30)
        layout = f"tp{r['tp']} pp{r['pp']} ep{r['ep'] or '-'} {r['backend'].split(':', 1)[1]}"
        out.append(
            f"| {r['model']} | {r['gpu']} | {layout} | {r['trtllm_version']} | {r['isl']}/{r['osl']} | "
            f"{float(r['value']):,.0f} ({r['metric']}) | {to_published_unit(r, pred[i]):,.0f} | "
            f"{pred[i] / comp.published[i]:.2f} | {case.bound} | {top} ({share:.0%} at peak rates) |"
        )
    return out


def _plot(path: Path, published: np.ndarray, pred: np.ndarray, kinds: np.ndarray) -> None:
    """One panel per regime (the PyTorch backend's max-load rows split into dense and MoE models)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)", file=sys.stderr)
        return
    panels = [
        k
        for k in ("engine max-load", "static batch", "batch-1 TTFT", "pytorch max-load, dense", "pytorch max-load, MoE")
        if ((kinds == k) & np.isfinite(pred)).any()
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.8), squeeze=False)
    for ax, kind in zip(axes[0], panels):
        m = (kinds == kind) & np.isfinite(pred) & np.isfinite(published)
        ax.scatter(published[m], pred[m], s=7, alpha=0.45)
        e = np.abs(pred[m] / published[m] - 1)
        lo, hi = min(published[m].min(), pred[m].min()) * 0.8, max(published[m].max(), pred[m].max()) * 1.25
        xs = np.array([lo, hi])
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, xs * 1.3, "k:", lw=0.6)
        ax.plot(xs, xs / 1.3, "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        unit = "ms" if "TTFT" in kind else "output tok/s"
        ax.set_xlabel(f"published ({unit})")
        ax.set_ylabel(f"predicted, leave-one-GPU-out ({unit})")
        ax.set_title(
            f"{kind}: {int(m.sum())} rows\nmedian {np.median(e):.1%}, p90 {np.percentile(e, 90):.1%} (dotted: +/-30%)",
            fontsize=9,
        )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
