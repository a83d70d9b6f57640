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
from trtpipe.perf.published import PUBLISHED_CSV, read_rows, regime

ROOT = Path(__file__).resolve().parents[1]
TRAIN_REGIMES = {"engine": ("engine max-load", "static batch", "batch-1 TTFT", "batch-1 ITL"),
                 "pytorch": ("pytorch max-load",)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--data", type=Path, default=PUBLISHED_CSV,
                    help="the published numbers (default: the copy in trtpipe/perf/data/, sources in SOURCES.md)")
    ap.add_argument("--out-constants", type=Path, default=F.CONSTANTS_FILE)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "results" / "perf_cv.png")
    ap.add_argument("--table", type=Path, default=ROOT / "docs" / "results" / "perf_fit.md")
    ap.add_argument("--no-cv", action="store_true", help="fit only")
    a = ap.parse_args(argv)

    rows = read_rows(a.data)
    regs = np.array([regime(r) for r in rows])
    fams = np.array([F.family(r) for r in rows])
    gpus = np.array([r["gpu"] for r in rows])
    compiled = [F.compile_rows(rows, g) for g in F.OTHER_GB_GRID]
    ok = compiled[0].ok
    constants, in_sample, cv, cv_pred = {}, {}, {}, np.full(len(rows), np.nan)
    for fam, regimes in TRAIN_REGIMES.items():
        train = ok & (fams == fam) & np.isin(regs, regimes)
        c, comp = F.fit_all(compiled, train)
        constants[fam] = c
        pred = F.predict(comp, c)
        for reg in regimes:
            in_sample[reg] = F.summary(F.abs_rel_errors(comp, train & (regs == reg), pred))
        if a.no_cv:
            continue
        for g in sorted(set(gpus[train])):
            c_g, comp_g = F.fit_all(compiled, train & (gpus != g))
            p = F.predict(comp_g, c_g)
            held = train & (gpus == g)
            cv_pred[held] = p[held]
            print(f"  [{fam}] without {g}: {F.summary(F.abs_rel_errors(comp_g, held, p))}", file=sys.stderr)
        for reg in regimes:
            cv[reg] = F.summary(F.abs_rel_errors(compiled[0], train & (regs == reg), cv_pred))
            cv[reg]["gpus"] = sorted(set(gpus[train & (regs == reg)]))

    a.out_constants.write_text(json.dumps({
        "source": "scripts/fit_perf.py on NVIDIA's published TensorRT-LLM performance tables",
        "constants": {k: asdict(v) for k, v in constants.items()},
        "in_sample": in_sample, "leave_one_gpu_out": cv}, indent=2) + "\n")
    lines = ["| regime | rows | in-sample median | in-sample p90 | LOGO median | LOGO p90 | GPUs held out in turn |",
             "|---|---|---|---|---|---|---|"]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for reg, s in in_sample.items():
        v = cv.get(reg, {})
        lines.append(f"| {reg} | {s['n']} | {pct(s['median'])} | {pct(s['p90'])} | {pct(v.get('median'))} | "
                     f"{pct(v.get('p90'))} | {', '.join(v.get('gpus', []))} |")
    lines.append("")
    lines.append("| constant | " + " | ".join(constants) + " |")
    lines.append("|---|" + "---|" * len(constants))
    for name in F.Constants.names():
        lines.append(f"| {name} | " + " | ".join(f"{getattr(c, name):.4g}" for c in constants.values()) + " |")
    a.table.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not a.no_cv:
        _plot(a.plot, compiled[0].published, cv_pred, regs)
    return 0


def _plot(path: Path, published: np.ndarray, pred: np.ndarray, regs: np.ndarray) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, kind in zip(axes, ("throughput", "latency")):
        for reg in sorted(set(regs)):
            is_lat = "TTFT" in reg or "ITL" in reg
            if is_lat != (kind == "latency"):
                continue
            m = (regs == reg) & np.isfinite(pred) & np.isfinite(published)
            if m.any():
                ax.scatter(published[m], pred[m], s=8, alpha=0.5, label=f"{reg} ({int(m.sum())})")
        lim = ax.get_xlim()
        lo, hi = min(lim[0], ax.get_ylim()[0]), max(lim[1], ax.get_ylim()[1])
        xs = np.array([lo, hi])
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, xs * 1.35, "k:", lw=0.6)
        ax.plot(xs, xs / 1.35, "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        unit = "total output tok/s" if kind == "throughput" else "ms"
        ax.set_xlabel(f"published ({unit})")
        ax.set_ylabel(f"predicted, leave-one-GPU-out ({unit})")
        ax.legend(fontsize=8)
        ax.set_title(f"{kind}: dotted lines = +/-35%")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
