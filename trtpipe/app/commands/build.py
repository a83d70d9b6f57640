"""``trtpipe build``: run the pipeline's stages, reusing cached artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--force", multiple=True, metavar="STAGE", help="Rerun STAGE even if cached (repeatable; 'all').")
@click.option("--from", "from_stage", metavar="STAGE", help="Rerun STAGE and all later ones; earlier must be cached.")
@click.option("--until", metavar="STAGE", help="Stop after STAGE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the manifest summary), nothing else.")
@click.pass_context
def build(ctx, recipe: Path, overrides, force, from_stage, until, as_json: bool) -> None:
    """Run the build stages that exist, reusing cached artifacts; write <work_dir>/manifest.json."""
    from trtpipe.errors import StageError
    from trtpipe.pipeline.runner import run_build
    from trtpipe.app.stage_table import STAGES
    from trtpipe.processes import sigterm_as_interrupt
    from trtpipe.app.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    stages = (ctx.obj or {}).get("stages") or STAGES  # a program embedding the CLI (the tests) may pass its own stages
    sigterm_as_interrupt()  # SIGTERM cleans up like Ctrl-C: temporary artifacts removed, manifest "interrupted"
    try:
        result = run_build(loaded, stages, force, from_stage, until, quiet=as_json, overrides=overrides)
    except StageError as exc:
        if as_json and getattr(exc, "result", None) is not None:
            click.echo(json.dumps(exc.result.summary(), indent=2))
        raise
    if as_json:
        click.echo(json.dumps(result.summary(), indent=2))
        return
    click.echo(f"manifest: {result.manifest_path}")
