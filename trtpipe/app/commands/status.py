"""``trtpipe status``: each stage's key and whether its artifact is cached; ``--verify`` re-hashes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--verify", is_flag=True, help="Re-hash every file listed in the last manifest (exit 1 on mismatch).")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@click.pass_context
def status(ctx, recipe: Path, overrides, verify: bool, as_json: bool) -> None:
    """Show each stage's key, whether its artifact is cached, and the last build."""
    from trtpipe.app.stage_table import STAGES
    from trtpipe.pipeline.runner import build_status, render_status
    from trtpipe.app.validation import load_recipe

    report = build_status(load_recipe(recipe, overrides), (ctx.obj or {}).get("stages") or STAGES, verify=verify)
    click.echo(json.dumps(report, indent=2) if as_json else render_status(report))
    if verify and report.get("verify"):
        sys.exit(1)
