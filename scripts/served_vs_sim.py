#!/usr/bin/env python
"""The simulator against the served twin, end to end: fit on one workload, predict another, measure with the bench.

    python scripts/served_vs_sim.py [--recipe recipes/stories-fp16.yaml] [--work DIR] [--concurrency 1,2,4,8,16]
                                    [--rounds 4] [--no-pin] [--reuse]

1. Build the recipe (streaming, 16 batch slots) and serve it detached on the CPU twin, with the twin writing one
   JSON line per executor iteration (``TRTPIPE_ITER_STATS``: TensorRT-LLM's IterationStats fields). The twin's
   executor gets the first CPU to itself, everything else (tritonserver, the other stubs, this script, AIPerf)
   the others: on a GPU the engine does not share the host's cores with the front end.
2. Each round, calibrate with ``trtpipe bench`` on workloads that are NOT the one evaluated (other prompt/output
   lengths and concurrencies; every bench call with its own prompt seed). From the served twin's own iteration
   records, fit the typical step cost by robust least squares: ``t = a + b x generating requests + c x context
   tokens + d x context requests + e x context query-key pairs + f x generating requests x longest generating
   position``, the measured steps' spread around it and the host time between consecutive steps (each simulated
   step draws its factor and gap from those). From the bench's per-request records: the time a first token spends
   outside the executor (client TTFT minus the executor's TTFT), and the time from a request's last token to the
   next request's arrival (executor clock), which the requests one step finishes share (they come back together),
   each by calibration concurrency (interpolated in between) with its spread.
3. Evaluate: ``trtpipe bench`` at each concurrency on the evaluation workload, and the same closed loop in the
   simulator (the serving ``ExecutorCore`` in simulated time, with the served repository's executor limits and
   that round's fitted costs). Prints measured vs simulated TTFT, TTFT inside the executor, ITL and output tok/s:
   medians over rounds, and the median of each round's ratio.

The fit, the grouping of returning requests and the comparison are ``trtpipe/perf/step_fit.py`` (tested in
tests/perf/test_step_fit.py); this script measures and drives them. Numbers are this machine's, measured in this
run. Not a test (timing); see docs/reference/perf-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np

from trtpipe.bench.aiperf import read_raw_server_fields
from trtpipe.perf.simulate import CostModelEngine, closed_loop
from trtpipe.perf.step_fit import ByConcurrency, StepCost, compare_rounds, fit_steps, return_gaps, worst_ratio_error
from trtpipe.serving import triton_adapter
from trtpipe.serving import api
from trtpipe.app.launch_triton import one_detached

ROOT = Path(__file__).resolve().parent.parent
# (concurrency list, isl, osl): calibration workloads, disjoint from the evaluation's lengths
CALIBRATION = (("2,6,12", 32, 96), ("3,10", 160, 24), ("1,16", 96, 40))


def _plain(o):
    """JSON for numpy numbers and enums."""
    return o.value if hasattr(o, "value") else float(o)


def cli(*args: str, env: dict | None = None, capture: bool = False) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", *args], env=env, text=True, stdout=subprocess.PIPE if capture else None
    )
    if res.returncode != 0:
        raise SystemExit(f"trtpipe {' '.join(args)}: exit {res.returncode}")
    return res.stdout or ""


def bench(repo: str, out: Path, conc: str, isl: int, osl: int, n: int, seed: int) -> list[dict]:
    """``trtpipe bench run`` against the detached server of ``repo`` (the served repository itself, so that it
    can never start a server of its own). Each call gets its own ``seed``: AIPerf's prompts of one seed start
    alike, and later calls would find their first KV blocks cached (the simulated prompts share nothing)."""
    cli(
        "bench",
        "run",
        repo,
        "-c",
        conc,
        "--isl",
        str(isl),
        "--osl",
        str(osl),
        "-n",
        str(n),
        "--out",
        str(out),
        "--seed",
        str(seed),
        capture=True,
    )
    return [json.loads(p.read_text()) for p in sorted(out.rglob("result.json"))]


def returns(aiperf_dir: Path, concurrency: int) -> dict:
    """:func:`trtpipe.perf.step_fit.return_gaps` of one bench point, from its server-side request fields."""
    arrivals, finals = [], []
    for fields in read_raw_server_fields(aiperf_dir).values():
        f = next((x for x in fields if "arrival_time_ns" in x and "last_token_time_ns" in x), None)
        if f is not None:
            arrivals.append(int(f["arrival_time_ns"]))
            finals.append(int(f["last_token_time_ns"]))
    g = return_gaps(arrivals, finals, concurrency)
    return {"returns": g.returns, "group": g.group, "jitter": g.jitter}


def point(doc: dict, aiperf_dir: Path) -> dict:
    m = doc["metrics"]
    return {
        "c": doc["load"]["concurrency"],
        **returns(aiperf_dir, doc["load"]["concurrency"]),
        "ttft_p50": m["ttft"]["p50"] / 1e3,
        "ttft_avg": m["ttft"]["avg"] / 1e3,
        "itl_p50": m["itl"]["p50"] / 1e3,
        "itl_avg": m["itl"]["avg"] / 1e3,
        "tok_s": m["output_token_throughput"]["value"],
        "outside_p50": doc["server_split"]["outside_executor"]["p50"] / 1e3,
        "outside": np.array(doc["samples"]["outside_executor"]) / 1e3,
        # TTFT inside the executor (first token - left the queue), per request, from the perf metrics
        "exec_ttft_p50": float(np.median(np.add(doc["samples"]["server_queue"], doc["samples"]["server_prefill"])))
        / 1e3,
    }


def executor_settings(http_url: str, repo: Path):
    with urllib.request.urlopen(f"{http_url}/v2/models/tensorrt_llm/config", timeout=10) as fh:
        return triton_adapter.settings_from_model_config(
            json.load(fh), str(repo / "tensorrt_llm")
        ).executor  # as the stub sees it


def pin(server_pid: int) -> str:
    """The twin's executor (the ``tensorrt_llm`` stub) alone on the first CPU; tritonserver, the other stubs, this
    script and the benches it starts on the others. On a GPU the engine computes apart from the host's front end;
    here, unpinned, the BLS, tritonserver and AIPerf take most of a 2-core machine at concurrency 16 and the
    executor's steps slow down with their load, which no step model of the executor alone can follow."""
    import psutil

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return "not pinned: one CPU"
    engine, rest = {cpus[0]}, set(cpus[1:])
    root = psutil.Process(server_pid)
    pinned = []
    for p in [root, *root.children(recursive=True)]:
        mine = "tensorrt_llm/1/model.py" in " ".join(p.cmdline())
        for tid in os.listdir(f"/proc/{p.pid}/task"):  # every thread: affinity is per thread
            try:
                os.sched_setaffinity(int(tid), engine if mine else rest)
            except OSError:  # a thread that just ended
                pass
        if mine:
            pinned.append(p.pid)
    os.sched_setaffinity(0, rest)
    return f"executor stub {pinned} on CPU {cpus[0]}, the rest on CPU {sorted(rest)}"


def measure(a, work: Path, sets: list[str]) -> None:
    """Build, serve with the iteration log on, then ``--rounds`` rounds of (calibration workloads, evaluation
    points): each round's evaluation is predicted from the same round's calibration, minutes apart (on a shared
    machine the same load runs 10-70 % faster or slower from one round to the next). Writes every bench result and
    each round's calibration steps under ``work``."""
    cli("build", a.recipe, *sets)
    iters = work / "iters.jsonl"
    iters.unlink(missing_ok=True)
    shutil.rmtree(work / "runs", ignore_errors=True)
    env = {**os.environ, triton_adapter.ITER_STATS_ENV: str(iters)}
    cli("serve", a.recipe, *sets, "--detach", env=env, capture=True)
    try:
        server = one_detached(Path(a.recipe), [s.split("=", 1)[1] for s in sets])
        if a.pin:
            print(pin(server.pid))
        config = executor_settings(server.http_url, Path(server.repo))
        (work / "executor.json").write_text(json.dumps(dataclasses.asdict(config), default=_plain))
        seen = 0
        for r in range(a.rounds):
            run = work / "runs" / f"round{r}"
            for k, (conc, isl, osl) in enumerate(CALIBRATION):
                bench(
                    server.repo,
                    run / "calibration" / str(k),
                    conc,
                    isl,
                    osl,
                    8 * max(map(int, conc.split(","))),
                    seed=1000 * r + k + 1,
                )
            lines = iters.read_text().splitlines()
            with open(run / "calibration_steps.jsonl", "w") as fh:  # this round's calibration workloads' steps only
                fh.writelines(line + "\n" for line in lines[seen:])
            for c in (int(x) for x in a.concurrency.split(",")):
                bench(
                    server.repo,
                    run / "evaluation" / f"c{c}",
                    str(c),
                    a.isl,
                    a.osl,
                    max(c * a.requests_per_client, a.min_requests),
                    seed=1000 * r + 100 + c,
                )
            seen = len(iters.read_text().splitlines())
    finally:
        cli("stop", a.recipe, *sets)


def load(work: Path):
    """What :func:`measure` wrote: executor limits, then per round its calibration points, calibration steps and
    evaluation points by concurrency."""
    fields = json.loads((work / "executor.json").read_text())
    config = api.ExecutorConfig(**{**fields, "capacity_policy": api.CapacityPolicy(fields["capacity_policy"])})
    rounds = []
    for run in sorted((work / "runs").glob("round*"), key=lambda p: int(p.name[5:])):
        points = lambda part: [  # noqa: E731
            point(json.loads(p.read_text()), p.parent / "aiperf") for p in sorted(run.glob(f"{part}/**/result.json"))
        ]
        records = [json.loads(line) for line in (run / "calibration_steps.jsonl").read_text().splitlines()]
        rounds.append((points("calibration"), records, {m["c"]: m for m in points("evaluation")}))
    return config, rounds


def by_concurrency(name: str, cal_points: list[dict], key: str) -> ByConcurrency:
    """One per-request time of the calibration points, by concurrency (printed as it is fitted)."""
    t = ByConcurrency.from_points((p["c"], p[key]) for p in cal_points)
    print(t.summary(name))
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "stories-fp16.yaml"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/trtpipe-served-vs-sim"))
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=8)
    ap.add_argument("--min-requests", type=int, default=32)
    ap.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds of calibration then evaluation (each predicted from its own calibration)",
    )
    ap.add_argument("--sim-seeds", type=int, default=9, help="simulated runs per point (medians are compared)")
    ap.add_argument("--reuse", action="store_true", help="fit and simulate on the last run's measurements")
    ap.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave the executor sharing every CPU with the front end and the bench",
    )
    a = ap.parse_args(argv)
    work = a.work.resolve()
    sets = [
        f"--set={s}"
        for s in (f"work_dir={work}", "triton.streaming=true", "engine.max_batch_size=16", "triton.max_batch_size=16")
    ]
    if not a.reuse:
        measure(a, work, sets)
    config, rounds = load(work)
    keys = ("ttft_p50", "exec_ttft_p50", "itl_p50", "tok_s")
    per_round = []  # per round: {c: (measured, simulated)}
    for r, (cal_points, records, evals) in enumerate(rounds):
        print(f"round {r}:")
        per_round.append(predict_round(a, config, cal_points, records, evals, keys))
    comparison = compare_rounds(per_round, keys)
    worst = worst_ratio_error(comparison)
    rows = [
        {
            "concurrency": r.concurrency,
            "measured": r.measured,
            "simulated": r.simulated,
            "ratio": r.ratio,
            "rounds": [{"measured": x[r.concurrency][0], "simulated": x[r.concurrency][1]} for x in per_round],
        }
        for r in comparison
    ]
    print(
        f"| concurrency | TTFT p50 ms: measured | sim | ratio | executor TTFT p50 ms: measured | sim | ratio | "
        f"ITL p50 ms: measured | sim | ratio | tok/s: measured | sim | ratio |   (medians over {len(rounds)} rounds; "
        f"ratio: median of each round's sim/measured)"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in comparison:
        cells = []
        for k in keys:
            scale, fmt = (1, "{:.0f}") if k == "tok_s" else (1e3, "{:.2f}" if k == "itl_p50" else "{:.1f}")
            cells += [fmt.format(r.measured[k] * scale), fmt.format(r.simulated[k] * scale), f"{r.ratio[k]:.2f}"]
        print(f"| {r.concurrency} | " + " | ".join(cells) + " |")
    print(f"worst |sim/measured - 1| = {worst:.1%} over {len(keys) * len(rows)} numbers")
    (work / "served_vs_sim.json").write_text(
        json.dumps({"executor": dataclasses.asdict(config), "rows": rows}, indent=1, default=_plain)
    )
    return 0


def predict_round(a, config, cal_points, records, evals, keys) -> dict:
    """Fit on one round's calibration, simulate that round's evaluation points: {c: (measured, simulated)}."""
    fit = fit_steps(records)
    print(fit.summary())
    cost = StepCost(fit)
    # outside the executor, measured at the calibration points: the time a request's first token spends there
    # (client TTFT - executor TTFT), and the time a client takes to come back with its next request
    outside = by_concurrency("first token outside the executor", cal_points, "outside")
    comeback = by_concurrency("last token to the next request's arrival", cal_points, "returns")
    # ... which requests freed by one step share: one draw per step, plus each request's own small offset
    group = np.concatenate([p["group"] for p in cal_points])
    jitter = np.concatenate([p["jitter"] for p in cal_points])
    print(
        f"  per step that frees requests: p10 {np.percentile(group, 10):.2f} p90 {np.percentile(group, 90):.2f} "
        f"of the median; each request's offset from its step's: p10 {np.percentile(jitter, 10):+.2f} "
        f"p90 {np.percentile(jitter, 90):+.2f}"
    )
    out = {}
    for c, measured in sorted(evals.items()):
        n = max(c * a.requests_per_client, a.min_requests)
        runs = []
        for seed in range(a.sim_seeds):  # the drawn stalls are rare and large: the median over seeded runs
            rng, cost.rng = np.random.default_rng(seed), np.random.default_rng(seed)
            # measured up to the step that took the request in; the simulator adds its own wait for a step (half a
            # step on average: a few % of this time)
            typical = comeback.median_at(c)
            r = closed_loop(
                config,
                CostModelEngine(step_cost=cost),
                c,
                n,
                a.isl,
                a.osl,
                client_gap_s=typical * rng.choice(jitter, size=n),
                step_gap_s=typical * rng.choice(group, size=n),
            )
            runs.append(
                {
                    "ttft_p50": float(np.median(r.executor_ttft + outside.draw(c, n, rng))),
                    "exec_ttft_p50": float(np.median(r.executor_ttft)),
                    "itl_p50": r.pct("itl", 50),
                    "tok_s": r.throughput,
                }
            )
        out[c] = ({k: measured[k] for k in keys}, {k: float(np.median([x[k] for x in runs])) for k in keys})
    return out


if __name__ == "__main__":
    sys.exit(main())
