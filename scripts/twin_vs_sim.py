#!/usr/bin/env python
"""The simulator checked end to end against a real system: the CPU twin's executor.

    python scripts/twin_vs_sim.py --model ../shared/models/stories260k [--isl 24 --osl 24]

1. Calibrate: serve a mixed workload (other prompts, batches of 1-16 requests) with the threaded executor the
   twin runs (``Executor`` + ``ReferenceEngine``, real tokens, real clock) and record every step's batch and
   measured time, plus the host time between steps. Fit a CPU step-cost model by least squares:
   ``t = a + b x generating requests + c x context tokens + d x attended KV tokens`` (+ the host time between steps). A warm-up
   run first; calibration and serving runs are interleaved and repeated, and the served side summarised by
   medians over the repeats, so that on a shared machine both sides carry the same share of its noise.
2. Evaluate on fresh requests (other seeds): closed-loop clients at concurrency 1, 2, 4, 8, 16 against the
   threaded ``Executor`` (what the Triton twin model runs) -- measured TTFT / ITL / throughput from the
   executor's perf metrics -- and the same workload through the simulator (the same ``ExecutorCore`` in
   simulated time, the fitted CPU cost as its step engine). Prints sim/measured ratios.

Numbers are this machine's; the script prints ratios measured in the same run. Not a test (timing).
"""

from __future__ import annotations

import os

# one intra-op thread in every thread (torch.set_num_threads only sets the calling thread's OpenMP team: the
# executor's own thread would otherwise run with the default team and the two sides would differ)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trtpipe.checkpoint.convert import convert  # noqa: E402
from trtpipe.perf.simulate import CostModelEngine, closed_loop  # noqa: E402
from trtpipe.runtime import load_checkpoint  # noqa: E402
from trtpipe.serving.api import ExecutorConfig, Request, StepBatch  # noqa: E402
from trtpipe.serving.executor import Executor  # noqa: E402
from trtpipe.serving.reference_engine import ReferenceEngine  # noqa: E402


def features(batch: StepBatch) -> list[float]:
    ctx = sum(len(e.tokens) for e in batch.entries if e.is_context)
    gen = sum(1 for e in batch.entries if not e.is_context)
    kv = sum(e.start_pos + len(e.tokens) for e in batch.entries)
    return [1.0, float(gen), float(ctx), float(kv)]


class Recording:
    """The reference engine, recording (features, measured seconds) of every step."""

    def __init__(self, inner: ReferenceEngine):
        self.inner, self.log = inner, []

    def allocate(self, n, tpb):
        self.inner.allocate(n, tpb)

    def copy_block(self, s, d, n):
        self.inner.copy_block(s, d, n)

    def step(self, batch):
        res = self.inner.step(batch)
        self.log.append((features(batch), res.elapsed_s))
        return res


def prompts(n: int, isl: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (isl,), generator=g).tolist() for _ in range(n)]


def _run_mixed(model, config: ExecutorConfig, isl: int, osl: int, warm: bool = False):
    """A mixed-concurrency workload through the threaded executor (as the twin serves): every step's features
    and measured time, and the host time between steps (loop, scheduling, responses)."""
    eng = Recording(ReferenceEngine(model))
    ex = Executor(config, eng, idle_wait_s=0.01)
    loads = ((1, 100), (16, 99)) if warm else ((1, 100), (2, 101), (4, 105), (6, 102), (8, 106), (12, 103), (16, 104))
    host = []
    for conc, seed in loads:
        work = prompts(conc * 3, isl, seed)
        left = [len(work)]
        done = threading.Event()

        def final(r, left=left, done=done):
            if r.is_final:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for p in work:
            ex.submit(Request(p, max_new_tokens=osl), final)
        done.wait()
        its = [i for i in ex.core.iterations if i.step_time_s > 0]
        host += [(b.timestamp_ns - a.timestamp_ns) / 1e9 - b.step_time_s for a, b in zip(its, its[1:])
                 if b.iteration == a.iteration + 1]
        ex.core.iterations.clear()
    ex.shutdown()
    return eng.log, host


def calibrate(runs: list) -> tuple[np.ndarray, float]:
    """Step-cost coefficients (Huber-weighted least squares over every recorded step of every run: a loaded
    machine adds rare stalls of tens of milliseconds that plain least squares would spread over every step) and
    the median host seconds between consecutive steps."""
    x = np.array([f for log, _ in runs for f, _ in log])
    y = np.array([t for log, _ in runs for _, t in log])
    host = float(np.median([h for _, hs in runs for h in hs]))
    w = np.ones_like(y)
    for _ in range(30):  # iteratively reweighted least squares, Huber weights at 1.345 robust sigmas
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        r = y - x @ coef
        sigma = 1.4826 * np.median(np.abs(r - np.median(r))) + 1e-12
        w = np.sqrt(np.minimum(1.0, 1.345 * sigma / np.maximum(np.abs(r), 1e-12)))
    coef = np.maximum(coef, 0.0)
    err = np.abs(x @ coef / y - 1)
    print(f"calibration: {len(y)} steps in {len(runs)} runs, step-time fit median |err| {np.median(err):.1%}, "
          f"p90 {np.percentile(err, 90):.1%}; coef (s) base {coef[0]:.2e} per-generating-request {coef[1]:.2e} "
          f"per-context-token {coef[2]:.2e} per-kv-token {coef[3]:.2e}; host between steps {host * 1e3:.3f} ms", file=sys.stderr)
    return coef, host


def served(model, config: ExecutorConfig, conc: int, n: int, isl: int, osl: int, seed: int) -> dict:
    """Closed loop against the threaded executor: ``conc`` client threads, n requests in all."""
    ex = Executor(config, ReferenceEngine(model), idle_wait_s=0.01)
    work = prompts(n, isl, seed)
    lock = threading.Lock()
    finals = []

    def client():
        while True:
            with lock:
                if not work:
                    return
                p = work.pop()
            done = threading.Event()
            box = []
            ex.submit(Request(p, max_new_tokens=osl, return_perf_metrics=True),
                      lambda r: (box.append(r), done.set()) if r.is_final else None)
            done.wait()
            with lock:
                finals.append(box[0])

    t0 = time.monotonic_ns()
    threads = [threading.Thread(target=client) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ex.shutdown()
    ttft = [(r.perf.first_token_ns - r.perf.enqueue_ns) / 1e9 for r in finals]
    itl = [(r.perf.last_token_ns - r.perf.first_token_ns) / 1e9 / (r.num_output_tokens - 1) for r in finals]
    last = max(r.perf.last_token_ns for r in finals)
    out = sum(r.num_output_tokens for r in finals)
    return {"ttft": float(np.mean(ttft)), "itl": float(np.mean(itl)), "tok_s": out / ((last - t0) / 1e9)}


def simulated(config: ExecutorConfig, coef: np.ndarray, host: float, conc: int, n: int, isl: int, osl: int) -> dict:
    cost = lambda b: (float(np.dot(features(b), coef)) + host, "cpu")  # noqa: E731
    r = closed_loop(config, CostModelEngine(step_cost=cost), conc, n, isl, osl)
    return {"ttft": float(r.ttft.mean()), "itl": float(r.itl.mean()), "tok_s": r.throughput}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--model", required=True, type=Path, help="HF model dir (e.g. shared/models/stories260k)")
    ap.add_argument("--isl", type=int, default=24)
    ap.add_argument("--osl", type=int, default=24)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests-per-client", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=5, help="runs of each measurement (medians are compared)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_checkpoint(convert(a.model, Path(tmp) / "ckpt", tp=1, pp=1, dtype="float32"))
        config = ExecutorConfig(max_batch_size=16, max_num_tokens=256, max_input_len=128, max_seq_len=256,
                                num_blocks=128, tokens_per_block=16, enable_chunked_context=True)
        concs = [int(c) for c in a.concurrency.split(",")]
        _run_mixed(model, config, a.isl, a.osl, warm=True)
        cal, runs = [], {c: [] for c in concs}
        for _ in range(a.repeat):  # interleaved, so calibration and serving see the same machine load
            cal.append(_run_mixed(model, config, a.isl, a.osl))
            for conc in concs:
                runs[conc].append(served(model, config, conc, max(conc * a.requests_per_client, 8), a.isl, a.osl,
                                         seed=1000 + conc))
        coef, host = calibrate(cal)
        print("| concurrency | TTFT measured ms | TTFT sim ms | ratio | ITL measured ms | ITL sim ms | ratio | "
              "tok/s measured | tok/s sim | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        worst = 0.0
        for conc in concs:
            n = max(conc * a.requests_per_client, 8)
            m = {k: float(np.median([r[k] for r in runs[conc]])) for k in ("ttft", "itl", "tok_s")}
            s = simulated(config, coef, host, conc, n, a.isl, a.osl)
            r = {k: s[k] / m[k] for k in m}
            worst = max(worst, *(abs(v - 1) for v in r.values()))
            print(f"| {conc} | {m['ttft'] * 1e3:.2f} | {s['ttft'] * 1e3:.2f} | {r['ttft']:.2f} | "
                  f"{m['itl'] * 1e3:.2f} | {s['itl'] * 1e3:.2f} | {r['itl']:.2f} | {m['tok_s']:.0f} | {s['tok_s']:.0f} | {r['tok_s']:.2f} |")
        print(f"worst |sim/measured - 1| = {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
