"""``trtpipe predict``: serving performance from the fitted cost model."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import MODEL_CONFIG, OVERRIDES


@click.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@MODEL_CONFIG
@click.option("--isl", type=int, default=1024, show_default=True, help="Input tokens per request.")
@click.option("--osl", type=int, default=256, show_default=True, help="Output tokens per request.")
@click.option("--concurrency", type=int, default=16, show_default=True, help="Closed-loop clients.")
@click.option("--rate", type=float, default=0.0, help="Poisson request rate (req/s) instead of --concurrency.")
@click.option("--num-requests", type=int, default=0, help="Requests to simulate (default: 4 x concurrency).")
@click.option(
    "--published",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A published-numbers CSV: quote the rows nearest to the prediction.",
)
@click.option(
    "--scenarios",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Predict every row of a published-format CSV (first 15 columns) instead of a recipe.",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="With --scenarios: the output CSV.")
@click.option(
    "--acceptance-length",
    type=float,
    help="Speculative decoding: tokens gained per target forward (accepted drafts + 1) for the recipe's "
    "speculative section; adds the predicted speed-up. Overrides speculative.acceptance_length.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def predict(
    recipe,
    overrides,
    gpu,
    model_config,
    isl,
    osl,
    concurrency,
    rate,
    num_requests,
    published,
    scenarios,
    out,
    acceptance_length,
    as_json,
) -> None:
    """Predicted serving performance (tok/s, TTFT/ITL percentiles, bounds) from the fitted cost model."""
    from trtpipe.app import prediction as predict_command

    if scenarios:
        if out is None:
            raise click.UsageError("--scenarios needs --out")
        predict_command.scenarios_command(scenarios, out)
        return
    if recipe is None:
        raise click.UsageError("RECIPE is required (or --scenarios FILE --out OUT)")
    predict_command.predict_command(
        recipe,
        overrides,
        gpu,
        model_config,
        isl,
        osl,
        concurrency,
        rate,
        num_requests,
        published,
        as_json,
        acceptance_length,
    )
