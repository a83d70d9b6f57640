"""``trtpipe bench``: AIPerf load against a served model (``run``), ``compare``, ``show``, ``plot``, ``cold``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, DefaultGroup, float_list, int_list


@click.group(cls=DefaultGroup)
def bench() -> None:
    """Benchmark a served model with NVIDIA AIPerf (default: bench run); compare results; cold start."""


@bench.command(name="run")
@click.argument("target", required=False, type=click.Path(exists=True, path_type=Path))
@OVERRIDES
@click.option("--server", "server", type=click.Path(exists=True, path_type=Path), help="Same as TARGET.")
@click.option("--url", help="HTTP HOST:PORT of a running server (instead of TARGET; needs --tokenizer).")
@click.option("--model", help="Front model (default: tensorrt_llm_bls when it streams, else the ensemble).")
@click.option("--tokenizer", help="Tokenizer directory (default: the repository's).")
@click.option("--metrics-url", help="tritonserver metrics endpoint (default: the served repository's metrics port).")
@click.option(
    "--concurrency", "-c", callback=int_list, help="Closed loop: requests in flight; a list sweeps (1,2,4,8)."
)
@click.option("--request-rate", callback=float_list, help="Open loop: requests/s; a list sweeps.")
@click.option(
    "--arrival",
    type=click.Choice(["poisson", "constant"]),
    default="poisson",
    show_default=True,
    help="Arrival process of --request-rate.",
)
@click.option(
    "--requests", "-n", "num_requests", type=click.IntRange(1, 1_000_000), help="Requests per point (default 32)."
)
@click.option("--duration", type=click.FloatRange(0.1), help="Seconds per point instead of a request count.")
@click.option(
    "--warmup", type=click.IntRange(0, 100_000), default=2, show_default=True, help="Warm-up requests per point."
)
@click.option("--isl", type=click.IntRange(1), help="Prompt tokens (default: min(128, max_input_len)).")
@click.option("--isl-stddev", type=click.IntRange(0), default=0, show_default=True)
@click.option("--osl", type=click.IntRange(1), help="Output tokens (default: min(64, max_seq_len - ISL)).")
@click.option(
    "--no-fixed-osl", is_flag=True, help="Let the model stop at EOS (default: end_id=-1 / min_tokens force OSL)."
)
@click.option(
    "--slo",
    help="Goodput SLOs, per-request bounds METRIC:VALUE[ms|s|us] (ttft, ttst, itl, tpot, e2e), "
    "e.g. ttft:200ms,itl:50ms.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Result directory (default: <work_dir>/bench/<time>-<label>, or ./bench-results/...).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON (one point) or the sweep index.")
def bench_run(
    target,
    overrides,
    server,
    url,
    model,
    tokenizer,
    metrics_url,
    concurrency,
    request_rate,
    arrival,
    num_requests,
    duration,
    warmup,
    isl,
    isl_stddev,
    osl,
    no_fixed_osl,
    slo,
    seed,
    out,
    as_json,
) -> None:
    """Benchmark TARGET (recipe or repository) with AIPerf; one result.json per load point, plots for sweeps."""
    from trtpipe.app.bench_run import bench_command

    bench_command(
        target or server,
        overrides,
        url,
        model,
        tokenizer,
        metrics_url,
        concurrency,
        request_rate,
        arrival,
        num_requests,
        duration,
        warmup,
        isl,
        isl_stddev,
        osl,
        not no_fixed_osl,
        slo,
        seed,
        out,
        as_json,
        echo=click.echo,
    )


@bench.command(name="compare")
@click.argument("a")
@click.argument("b")
@click.option(
    "--fail-if",
    "fail_if",
    multiple=True,
    metavar="METRIC.STAT>+N%",
    help="Exit 1 when B crosses this (and its 95% CI excludes no change), e.g. 'ttft.p99>+10%'.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
@click.option("--json", "as_json", is_flag=True)
def bench_compare(a, b, fail_if, seed, as_json) -> None:
    """Compare bench results A and B (result.json or its directory; several runs of one side: A1,A2,A3):
    deltas, bootstrap CIs, gates."""
    from trtpipe.bench.compare import compare_paths, render

    result, warn = compare_paths(a, b, fail_if, seed)
    click.echo(json.dumps(result, indent=1) if as_json else render(result))
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if result["failed"]:
        sys.exit(1)


@bench.command(name="show")
@click.argument("result", type=click.Path(exists=True, path_type=Path))
@click.option("--aiperf", "side_by_side", is_flag=True, help="Also print trtpipe's numbers next to AIPerf's export.")
def bench_show(result, side_by_side) -> None:
    """Print a bench result (result.json or its directory)."""
    from trtpipe.bench.run import agreement_table, load_result, render

    doc = load_result(result)
    click.echo(render(doc))
    if side_by_side:
        click.echo(agreement_table(doc))


@bench.command(name="plot")
@click.argument("sweep_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def bench_plot(sweep_dir) -> None:
    """Redraw a sweep's plots and sweep.csv from its result files."""
    from trtpipe.bench.sweep import load_sweep, write_sweep

    index = write_sweep(sweep_dir, load_sweep(sweep_dir))
    click.echo("plots: " + ", ".join(index["plots"]))


@bench.command(name="cold")
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--warm-requests", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_cold(recipe, overrides, warm_requests, max_tokens, as_json) -> None:
    """Start a fresh server for RECIPE; time its load, its first (cold) request and the warm ones after it."""
    from trtpipe.app.bench_cold import measure_cold, render

    result = measure_cold(recipe, overrides, warm_requests=warm_requests, max_tokens=max_tokens)
    click.echo(json.dumps(result, indent=1) if as_json else render(result))
