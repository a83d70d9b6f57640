"""``trtpipe eval``: the verify stage's accuracy report (the build up to it)."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, build_until


@click.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the table.")
def eval_(recipe: Path, overrides, as_json: bool) -> None:
    """Accuracy report of the quantized model against the unquantized one; fails when the recipe's gate does."""
    _, path = build_until(recipe, overrides, "verify")
    click.echo((path / "accuracy.json").read_text() if as_json else (path / "accuracy.txt").read_text())
