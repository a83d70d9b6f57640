"""``trtpipe bench run``: turn the command line into load points, find the server, run, print."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpipe.bench.aiperf import Load
from trtpipe.bench.metrics import BenchError, parse_slo
from trtpipe.extras import pyplot

DEFAULT_REQUESTS = 32


def default_lengths(target, isl: Optional[int], osl: Optional[int]) -> tuple[int, int]:
    """ISL/OSL within the engine's limits: 128 prompt and 64 output tokens unless the engine is smaller."""
    if isl is None:
        isl = min(128, target.max_input_len or 128)
    if osl is None:
        room = (target.max_seq_len - isl) if target.max_seq_len else 64
        osl = max(1, min(64, room))
    return isl, osl


def make_loads(
    concurrency: Optional[Sequence[int]],
    rates: Optional[Sequence[float]],
    arrival: str,
    requests: Optional[int],
    duration: Optional[float],
    warmup: int,
    isl: int,
    osl: int,
    isl_stddev: int,
    seed: int,
) -> list[Load]:
    """One Load per concurrency, or per rate (capped by a single concurrency when both are given)."""
    if duration is None and requests is None:
        requests = DEFAULT_REQUESTS
    common = dict(
        arrival=arrival,
        requests=requests,
        duration_s=duration,
        warmup_requests=warmup,
        isl=isl,
        osl=osl,
        isl_stddev=isl_stddev,
        seed=seed,
    )
    if rates:
        if concurrency and len(concurrency) > 1:
            raise BenchError(
                "sweep either --concurrency or --request-rate, not both (one concurrency caps a rate sweep)"
            )
        cap = concurrency[0] if concurrency else None
        loads = [Load(concurrency=cap, request_rate=r, **common) for r in rates]
    else:
        loads = [Load(concurrency=c, **common) for c in (concurrency or [1])]
    for load in loads:
        load.check()
    return loads


def bench_command(
    target,
    overrides,
    url,
    model,
    tokenizer,
    metrics_url,
    concurrency,
    rates,
    arrival,
    requests,
    duration,
    warmup,
    isl,
    isl_stddev,
    osl,
    fixed_osl: bool,
    slo_text,
    seed,
    out: Optional[Path],
    as_json: bool,
    echo: Callable[[str], None] = print,
) -> dict:
    from trtpipe.bench.aiperf import find_aiperf
    from trtpipe.bench.run import render, run_point
    from trtpipe.app.bench_session import bench_target
    from trtpipe.bench.sweep import run_sweep

    slo = parse_slo(slo_text) if slo_text else None
    if out is not None and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise BenchError(
            f"{out}: already exists and is not empty; choose another --out (results are never overwritten)"
        )
    binary = find_aiperf()
    with bench_target(target, overrides, url, model, tokenizer, metrics_url) as (tgt, recipe):
        i, o = default_lengths(tgt, isl, osl)
        loads = make_loads(concurrency, rates, arrival, requests, duration, warmup, i, o, isl_stddev, seed)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = "sweep" if len(loads) > 1 else loads[0].label()
        if out is None:
            base = recipe.work_path / "bench" if recipe is not None else Path("bench-results")
            out = base / f"{stamp}-{name}"
        if len(loads) == 1:
            doc = run_point(tgt, loads[0], out, slo, recipe, binary=binary, fixed_output=fixed_osl)
            echo(json.dumps(doc, indent=1) if as_json else render(doc) + f"\nresult: {out / 'result.json'}")
            return doc
        pyplot("trtpipe bench (sweep plots)")  # before the sweep runs, not after
        log = (lambda msg: None) if as_json else echo
        index = run_sweep(tgt, loads, out, slo, recipe, log=log, binary=binary, fixed_output=fixed_osl)
        echo(
            json.dumps(index, indent=1)
            if as_json
            else f"sweep: {out / 'sweep.csv'}\nplots: " + ", ".join(index["plots"])
        )
        return index
