"""``trtpipe quantize``: the build up to the quantize stage."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, build_until


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
def quantize(recipe: Path, overrides) -> None:
    """Write the quantized TensorRT-LLM checkpoint (calibrating first when needed); print its path."""
    _, path = build_until(recipe, overrides, "quantize")
    click.echo(f"quantized checkpoint: {path}")
