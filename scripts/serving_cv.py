#!/usr/bin/env python
"""Serving regime (TTFT / ITL under load) of the published tables, through the simulator.

    python scripts/serving_cv.py [--data trtpipe/perf/data/published_trtllm.csv] [--requests 500]

The published serving rows (Triton backend request-rate sweep, NIM closed-loop concurrency) are all on one GPU
type, so "leave one GPU out" means: fit the engine constants without that GPU's rows (every regime), then run
the executor in simulated time at each published rate / concurrency and compare mean TTFT, mean ITL and
throughput. Also printed: the same with the constants fitted on everything (in-sample). Slow (minutes): every
distinct load point is one simulation of the published request count.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from trtpipe.perf import fit as F
from trtpipe.app.predictor import predict_scenarios
from trtpipe.perf.published import PUBLISHED_CSV, read_rows, regime

TRAIN = ("engine max-load", "static batch", "batch-1 TTFT", "batch-1 ITL")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--data", type=Path, default=PUBLISHED_CSV, help="default: trtpipe/perf/data/published_trtllm.csv")
    ap.add_argument("--requests", type=int, default=500, help="requests per rate point (the published sweep: 500)")
    ap.add_argument("--out", type=Path, help="write the per-row predictions as JSON")
    a = ap.parse_args(argv)
    rows = read_rows(a.data)
    regs = np.array([regime(r) for r in rows])
    fams = np.array([F.family(r) for r in rows])
    gpus = np.array([r["gpu"] for r in rows])
    serving = [i for i, r in enumerate(rows) if regs[i].startswith("serving") and fams[i] == "engine"]
    held = sorted(set(gpus[serving]))
    compiled = [F.compile_rows(rows, g) for g in F.OTHER_GB_GRID]
    train = compiled[0].ok & (fams == "engine") & np.isin(regs, TRAIN)
    sets = {"in-sample": F.fit_all(compiled, train)[0]}
    sets["leave-one-GPU-out"] = F.fit_all(compiled, train & ~np.isin(gpus, held))[0]
    sub = [rows[i] for i in serving]
    report = {}
    for name, c in sets.items():
        pred = predict_scenarios(sub, {"engine": c}, serving_requests=a.requests)
        by_metric: dict[str, list[float]] = {}
        for r, p in zip(sub, pred):
            if p is None:
                continue
            by_metric.setdefault(r["metric"], []).append(abs(p / float(r["value"]) - 1))
        report[name] = {
            m: {"n": len(e), "median": float(np.median(e)), "p90": float(np.percentile(e, 90))}
            for m, e in sorted(by_metric.items())
        }
        report[name + " rows"] = [
            {
                "model": r["model"],
                "isl": r["isl"],
                "osl": r["osl"],
                "metric": r["metric"],
                "load": r["concurrency_or_batch"],
                "published": float(r["value"]),
                "predicted": p,
            }
            for r, p in zip(sub, pred)
        ]
        print(f"{name} (held out: {', '.join(held)}):")
        for m, s in report[name].items():
            print(f"  {m:30s} n={s['n']:3d}  median {100 * s['median']:.1f}%  p90 {100 * s['p90']:.1f}%")
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
