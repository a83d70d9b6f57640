"""``trtpipe gc``: list or delete artifacts that no current key and no last build uses."""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--delete", is_flag=True, help="Delete the unused artifacts (default: only list them).")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of lines.")
@click.pass_context
def gc(ctx, recipe: Path, overrides, delete: bool, as_json: bool) -> None:
    """List (or --delete) artifacts that neither the recipe's current keys nor the last build use."""
    from trtpipe.app.stage_table import STAGES
    from trtpipe.pipeline.runner import collect_garbage, render_garbage
    from trtpipe.app.validation import load_recipe

    report = collect_garbage(load_recipe(recipe, overrides), (ctx.obj or {}).get("stages") or STAGES, delete=delete)
    click.echo(json.dumps(report, indent=2) if as_json else render_garbage(report, delete))
