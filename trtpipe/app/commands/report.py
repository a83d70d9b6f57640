"""``trtpipe report``: accuracy, memory and bench numbers of several recipes side by side."""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@OVERRIDES
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("report"),
    show_default=True,
    help="Where report.json, report.md and report.png go.",
)
@click.option("--json", "as_json", is_flag=True)
def report(recipes, overrides, out, as_json) -> None:
    """Which build to deploy: accuracy (verify), memory (plan) and bench numbers of several recipes, side by side."""
    from trtpipe.app.deploy_report import build_report

    doc = build_report(list(recipes), overrides, out)
    click.echo(json.dumps(doc, indent=1) if as_json else doc["text"])
