#!/usr/bin/env python
"""The simulator checked end to end against a real system: the CPU twin's executor.

    python scripts/twin_vs_sim.py --model ../shared/models/stories260k [--isl 24 --osl 24]

1. Calibrate: serve a mixed workload with the real executor (``ExecutorCore`` + ``ReferenceEngine``, real
   tokens, real clock) and record every step's batch and measured time, plus the host time of each loop turn
   outside the step. Fit a CPU step-cost model by least squares:
   ``t = a + b x entries + c x context tokens + d x attended KV tokens`` (+ the mean host time per turn).
2. Evaluate on fresh requests (other seeds): closed-loop clients at concurrency 1, 2, 4, 8, 16 against the
   threaded ``Executor`` (what the Triton twin model runs) -- measured TTFT / ITL / throughput from the
   executor's perf metrics -- and the same workload through the simulator (the same ``ExecutorCore`` in
   simulated time, the fitted CPU cost as its step engine). Prints sim/measured ratios.

Numbers are this machine's; the script prints ratios measured in the same run. Not a test (timing).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from trtpipe.checkpoint.convert import convert
from trtpipe.perf.simulate import CostModelEngine, closed_loop
from trtpipe.runtime import load_checkpoint
from trtpipe.serving.api import ExecutorConfig, Request, StepBatch
from trtpipe.serving.executor import Executor, ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine


def features(batch: StepBatch) -> list[float]:
    ctx = sum(len(e.tokens) for e in batch.entries if e.is_context)
    kv = sum(e.start_pos + len(e.tokens) for e in batch.entries)
    return [1.0, float(len(batch.entries)), float(ctx), float(kv)]


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


def calibrate(model, config: ExecutorConfig, isl: int, osl: int) -> tuple[np.ndarray, float]:
    """Step-cost coefficients and the mean host seconds per loop turn, from a mixed-concurrency run."""
    eng = Recording(ReferenceEngine(model))
    core = ExecutorCore(config, eng, lambda r: None)
    host = []
    for conc, seed in ((2, 101), (6, 102), (12, 103), (16, 104)):
        for p in prompts(conc * 3, isl, seed):
            core.submit(Request(p, max_new_tokens=osl))
        while True:
            n = len(eng.log)
            t0 = time.perf_counter()
            more = core.iterate()
            wall = time.perf_counter() - t0
            if len(eng.log) > n:
                host.append(wall - eng.log[-1][1])
            if not more:
                break
    x = np.array([f for f, _ in eng.log])
    y = np.array([t for _, t in eng.log])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    err = np.abs(pred / y - 1)
    print(f"calibration: {len(y)} steps, step-time fit median |err| {np.median(err):.1%}, p90 {np.percentile(err, 90):.1%};"
          f" coef (s) base {coef[0]:.2e} per-entry {coef[1]:.2e} per-ctx-token {coef[2]:.2e} per-kv-token "
          f"{coef[3]:.2e}; host per turn {np.mean(host) * 1e3:.3f} ms", file=sys.stderr)
    return coef, float(np.mean(host))


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
    ap.add_argument("--requests-per-client", type=int, default=4)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_checkpoint(convert(a.model, Path(tmp) / "ckpt", tp=1, pp=1, dtype="float32"))
        config = ExecutorConfig(max_batch_size=16, max_num_tokens=256, max_input_len=128, max_seq_len=256,
                                num_blocks=128, tokens_per_block=16, enable_chunked_context=True)
        coef, host = calibrate(model, config, a.isl, a.osl)
        print("| concurrency | TTFT measured ms | TTFT sim ms | ratio | ITL measured ms | ITL sim ms | ratio | "
              "tok/s measured | tok/s sim | ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        worst = 0.0
        for conc in (int(c) for c in a.concurrency.split(",")):
            n = max(conc * a.requests_per_client, 8)
            m = served(model, config, conc, n, a.isl, a.osl, seed=1000 + conc)
            s = simulated(config, coef, host, conc, n, a.isl, a.osl)
            r = {k: s[k] / m[k] for k in m}
            worst = max(worst, *(abs(v - 1) for v in r.values()))
            print(f"| {conc} | {m['ttft'] * 1e3:.2f} | {s['ttft'] * 1e3:.2f} | {r['ttft']:.2f} | {m['itl'] * 1e3:.2f} | "
                  f"{s['itl'] * 1e3:.2f} | {r['itl']:.2f} | {m['tok_s']:.0f} | {s['tok_s']:.0f} | {r['tok_s']:.2f} |")
        print(f"worst |sim/measured - 1| = {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
