"""What ``trtpipe predict`` and ``trtpipe plan --slo`` print (the CLI stays thin)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

import click

from trtpipe.errors import TrtpipeError
from trtpipe.extras import pyplot
from trtpipe.app import predictor as P
from trtpipe.perf.fit import load_constants, predict_rows
from trtpipe.perf.published import read_rows


def predict_command(
    recipe: Path,
    overrides: Iterable[str],
    gpu: Optional[str],
    model_config: Optional[Path],
    isl: int,
    osl: int,
    concurrency: int,
    rate: float,
    num_requests: int,
    published: Optional[Path],
    as_json: bool,
    acceptance_length: Optional[float] = None,
) -> None:
    setup = P.recipe_setup(recipe, overrides, gpu=gpu, model_config=model_config)
    c = load_constants()[setup.family]
    res = P.simulate(setup, c, isl, osl, concurrency=concurrency, rate=rate, num_requests=num_requests)
    s = P.summary(setup, res)
    s["workload"] = {"isl": isl, "osl": osl, **({"rate": rate} if rate else {"concurrency": concurrency})}
    s["kv_pool_tokens"] = setup.kv_tokens
    s["engine_limits"] = {"max_batch_size": setup.max_batch_size, "max_num_tokens": setup.max_num_tokens}
    from trtpipe.app.spec_prediction import recipe_acceptance_length

    acceptance_length = recipe_acceptance_length(recipe, overrides, acceptance_length)
    if acceptance_length is not None:
        from trtpipe.app.spec_prediction import speculative_block

        batch = max(1, min(setup.max_batch_size, round(s["mean_batch"]) if rate else concurrency))
        ov = list(overrides) + ([f"engine.gpu={gpu}"] if gpu else [])
        s["speculative"] = speculative_block(recipe, ov, setup.deployment, c, s, batch, isl, osl, acceptance_length)
    if published:
        d = setup.deployment
        near = P.nearest_published(
            read_rows(published), d.model, d.gpu, d.precision, isl, osl, d.num_gpus, fam=setup.family
        )
        ours = predict_rows(near, load_constants())
        keys = (
            "trtllm_version",
            "backend",
            "model",
            "precision",
            "gpu",
            "tp",
            "pp",
            "ep",
            "isl",
            "osl",
            "metric",
            "concurrency_or_batch",
            "value",
        )
        s["nearest_published"] = [{**{k: r[k] for k in keys}, "predicted": p} for r, p in zip(near, ours)]
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    load = f"rate {rate:g} req/s" if rate else f"concurrency {concurrency}"
    click.echo(
        f"{setup.label}: ISL {isl} / OSL {osl}, {load}, {s['requests']} simulated requests "
        f"(KV pool {setup.kv_tokens} tokens, max_batch_size {setup.max_batch_size})"
    )
    click.echo(f"  output tok/s   {s['output_tok_s']:>10,.1f} total   {s['output_tok_s_per_gpu']:>9,.1f} per GPU")
    for name in ("ttft_ms", "itl_ms"):
        v = s[name]
        click.echo(
            f"  {name[:-3].upper():5s} ms      p50 {v['p50']:>9.2f}   p90 {v['p90']:>9.2f}   p99 {v['p99']:>9.2f}"
        )
    shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(s["step_time_share"].items(), key=lambda x: -x[1]))
    click.echo(
        f"  bounds: step time by {s['step_time_bound']} ({shares}); batch by {s['batch_bound']} "
        f"(mean batch {s['mean_batch']})"
    )
    if "speculative" in s:
        v = s["speculative"]
        click.echo(
            f"  speculative {v['decoding_type']} k={v['max_draft_len']}, acceptance length "
            f"{v['acceptance_length']:g} at batch {v['batch']}: step {v['plain_step_ms']:.2f} ms plain, "
            f"{v['verify_step_ms']:.2f} ms verify + {v['draft_ms']:.2f} ms draft -> decode x{v['decode_speedup']:.2f}, "
            f"ITL p50 {v['itl_ms_p50']:.2f} ms, {v['output_tok_s']:,.1f} tok/s"
        )
    if published and not s["nearest_published"]:
        click.echo(f"  nearest published numbers: none for this model on {setup.deployment.gpu.key} in {published}")
    if s.get("nearest_published"):
        click.echo("  nearest published numbers (their method), with this model's prediction for the same row:")
    for r in s.get("nearest_published", []):
        pred = "not predicted" if r["predicted"] is None else f"{r['predicted']:,.1f}"
        click.echo(
            f"    {r['model']} {r['precision']} {r['gpu']} tp{r['tp']} ep{r['ep'] or '-'} {r['backend']} "
            f"{r['isl']}/{r['osl']} "
            f"{r['concurrency_or_batch']} (TRT-LLM {r['trtllm_version']}): {r['metric']} published "
            f"{float(r['value']):,.1f}, predicted {pred}"
        )


def scenarios_command(src: Path, dst: Path) -> None:
    n = P.write_scenarios(src, dst, load_constants())
    click.echo(f"wrote {dst}: {n} rows predicted")


def plan_command(
    recipe: Path,
    overrides: Iterable[str],
    model_config: Optional[Path],
    slo: str,
    rate: float,
    isl: int,
    osl: int,
    gpus: Optional[str],
    plot: Optional[Path],
    as_json: bool,
    precisions: Optional[str] = None,
) -> None:
    targets = P.parse_slo(slo)
    if plot and plot.exists():
        raise TrtpipeError(f"{plot}: already exists; choose another --plot (nothing is overwritten)")
    if plot:
        pyplot("trtpipe plan --plot")  # before the simulations, not after
    keys = [g.strip() for g in gpus.split(",")] if gpus else None
    log = None if as_json else (lambda m: click.echo(f"  .. {m}", err=True))
    algos = [p.strip() for p in precisions.split(",")] if precisions else []
    rows = P.capacity_plan(recipe, targets, rate, isl, osl, overrides, keys, model_config, log=log, precisions=algos)
    if plot:
        P.plot_plan(rows, plot, f"{recipe.name}: SLO {slo} at {rate:g} req/s, ISL {isl}/OSL {osl}")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(
        f"SLO {slo} at {rate:g} req/s (Poisson arrivals), ISL {isl} / OSL {osl}; fewest GPUs first "
        f"(ties: lower-bandwidth, usually cheaper, GPU first):"
    )
    for o in rows:
        if not o.get("fits"):
            continue
        mark = "MEETS" if o["meets_slo"] else "misses"
        head = ", ".join(f"{k} x{v}" for k, v in o["headroom"].items())
        click.echo(
            f"  {mark:6s} {o['total_gpus']:3d} GPUs = {o['replicas']:2d} x [{o['layout']}]  TTFT p99 "
            f"{o['ttft_ms']['p99']:>8.1f} ms  ITL p99 {o['itl_ms']['p99']:>6.1f} ms  "
            f"{o['output_tok_s_per_gpu']:>7.1f} tok/s/GPU  headroom {head}"
        )
    skipped = [o for o in rows if not o.get("fits")]
    if skipped:
        click.echo(f"  not modelled or not fitting: {', '.join(o['layout'] for o in skipped)}")
        for why in dict.fromkeys(o["why"] for o in skipped):
            click.echo(f"    because: {why}")
    if plot:
        click.echo(f"wrote {plot}")
