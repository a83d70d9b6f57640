"""``trtpipe plan``: the memory plan per GPU; with ``--slo``, the cheapest layouts that meet it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtpipe.app.options import CHECKPOINT, MODEL_CONFIG, OVERRIDES


@click.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@MODEL_CONFIG
@CHECKPOINT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--list-gpus", is_flag=True, help="Print the GPU catalog and exit.")
@click.option(
    "--slo",
    help="Capacity answer: latency targets METRIC[_pQ]:VALUE[ms|s|us] (ttft, itl, e2e; no _pQ: "
    "every request), e.g. ttft_p99=500ms,itl_p99=50ms (with --rate).",
)
@click.option("--rate", type=float, default=0.0, help="Poisson request rate (req/s) the SLO must hold at.")
@click.option(
    "--isl",
    type=int,
    default=1024,
    show_default=True,
    help="Input tokens per request (with --slo or an acceptance length).",
)
@click.option(
    "--osl",
    type=int,
    default=256,
    show_default=True,
    help="Output tokens per request (with --slo or an acceptance length).",
)
@click.option("--gpus", help="Comma-separated catalog keys to consider (with --slo; default: every modelled GPU).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write throughput vs latency PNG.")
@click.option("--precisions", help="With --slo: quantization.algo variants to compare, e.g. fp8,int4_awq,none.")
@click.option(
    "--acceptance-length",
    type=float,
    help="Speculative decoding: tokens per target forward (accepted drafts + 1); adds the decode speed-up at "
    "max_batch_size. Overrides speculative.acceptance_length.",
)
def plan(
    recipe,
    overrides,
    gpu,
    model_config,
    checkpoint,
    as_json,
    list_gpus,
    slo,
    rate,
    isl,
    osl,
    gpus,
    plot,
    precisions,
    acceptance_length,
) -> None:
    """Memory plan per GPU: weights, activations, KV pool and concurrent sequences; exit 3 if it does not fit.

    With --slo and --rate: the cheapest layouts (GPU type and count, tp) predicted to meet the SLO."""
    from trtpipe.app import planning

    if slo:
        if recipe is None or rate <= 0:
            raise click.UsageError("--slo needs RECIPE and --rate")
        from trtpipe.app import prediction as predict_command

        predict_command.plan_command(
            recipe, overrides, model_config, slo, rate, isl, osl, gpus, plot, as_json, precisions
        )
        return
    if list_gpus:
        click.echo(planning.gpu_table())
        return
    if recipe is None:
        raise click.UsageError("RECIPE is required (or --list-gpus)")
    r = planning.resolve(recipe, overrides, gpu=gpu, model_config=model_config, checkpoint=checkpoint)
    out = planning.plan_json(r) if as_json else planning.render_plan(r)
    if r.plan.fits:
        from trtpipe.app.spec_prediction import plan_block, recipe_acceptance_length

        al = recipe_acceptance_length(recipe, overrides, acceptance_length)
        if al is not None:
            v = plan_block(recipe, overrides, gpu, model_config, isl, osl, al)
            if as_json:
                out["speculative"] = v
            else:
                out += (
                    f"\nspeculative {v['decoding_type']} k={v['max_draft_len']}, acceptance length "
                    f"{v['acceptance_length']:g}: decode step x{v['decode_speedup']:.2f} at batch {v['batch']}, KV "
                    f"length {v['kv_len']} (trtpipe predict gives the served figures)"
                )
    click.echo(json.dumps(out, indent=2) if as_json else out)
    if not r.plan.fits:
        sys.exit(3)
