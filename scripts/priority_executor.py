"""Interactive time-to-first-token at the executor itself (submit to the first token's callback, no HTTP, no
tokenizer), alone and beside closed-loop low-priority batch requests, plus the executor's step cost by kind: where
``priority_ttft.py``'s end-to-end numbers come from. One process, the real :class:`~trtpipe.serving.executor.Executor`
over the reference runtime of an llmapi recipe's export (built first if needed)::

    python scripts/priority_executor.py recipes/stories-llmapi-fp8.yaml [--seconds 40] [--prompt-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def _pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def main() -> int:
    from trtpipe.serving.api import Request, SamplingParams
    from trtpipe.serving.openai_launch import resolve_openai_target
    from trtpipe.serving.openai_server import ServedModel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rps", type=float, default=4.0, help="interactive requests per second (Poisson)")
    ap.add_argument("--prompt-tokens", type=int, default=4, help="interactive prompt: fresh random token ids")
    ap.add_argument("--batch-clients", type=int, default=24)
    ap.add_argument("--set", action="append", default=["triton.scheduler_policy=max_utilization"])
    args = ap.parse_args()
    t = resolve_openai_target(args.target, args.set)
    served = ServedModel(t.model_dir, "priority", t.config)
    ex, tok, eos = served.executor, served.tokenizer, served.eos_id
    batch_prompt = tok.encode("The little dog ran to the park and")
    state = {"stop": False, "done": 0}

    def batch_one():
        def on_response(r):
            if r.is_final:
                state["done"] += 1
                if not state["stop"]:
                    batch_one()
        ex.submit(Request(prompt=batch_prompt, max_new_tokens=64, end_id=eos, sampling=SamplingParams(),
                          streaming=False, exclude_input_from_output=True, priority=0.1), on_response)

    def phase(batch: bool) -> dict:
        state.update(stop=False, done=0)
        if batch:
            for _ in range(args.batch_clients):
                batch_one()
            time.sleep(2.0)
        rng, firsts = random.Random(0), []
        first_iter = ex.core.iteration
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            t0, first = time.perf_counter(), []

            def on_response(r, t0=t0, first=first):
                if r.tokens and not first:
                    first.append(1e3 * (time.perf_counter() - t0))
            prompt = [rng.randrange(3, served.vocab_size) for _ in range(args.prompt_tokens)]
            ex.submit(Request(prompt=prompt, max_new_tokens=8, end_id=eos, sampling=SamplingParams(), streaming=True,
                              exclude_input_from_output=True, priority=0.9), on_response)
            firsts.append(first)
            time.sleep(rng.expovariate(args.rps))
        state["stop"] = True
        while ex.core.busy:
            time.sleep(0.05)
        steps: dict = {}
        for it in ex.core.iterations:
            if it.iteration >= first_iter and it.num_scheduled:
                kind = f"{'context+' if it.num_context_requests else ''}{it.num_scheduled} scheduled"
                steps.setdefault(kind, []).append(1e3 * it.step_time_s)
        xs = [f[0] for f in firsts if f]
        return {"interactive": len(xs), "ttft_p50_ms": _pct(xs, 0.5), "ttft_p90_ms": _pct(xs, 0.9),
                "ttft_p99_ms": _pct(xs, 0.99), "batch_completed": state["done"],
                "step_ms_median": {k: [len(v), round(statistics.median(v), 2)] for k, v in sorted(steps.items())}}

    try:
        out = {"prompt_tokens": args.prompt_tokens, "seconds": args.seconds, "alone": phase(False),
               "with_low_priority_batch": phase(True)}
    finally:
        ex.shutdown()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
