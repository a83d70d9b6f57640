"""``trtpipe calibrate``: the build up to the calibrate stage."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, build_until


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--force", is_flag=True, help="Recompute even when cached statistics exist.")
def calibrate(recipe: Path, overrides, force: bool) -> None:
    """Run calibration alone; print where its statistics are (reused by every algorithm that can)."""
    _, path = build_until(recipe, overrides, "calibrate", ("calibrate",) if force else ())
    click.echo(f"calibration statistics: {path}")
