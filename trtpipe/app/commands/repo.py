"""``trtpipe repo``: write the Triton model repository."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option(
    "--engine",
    "engine_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Use this engine dir (TensorRT or CPU twin) instead of building the recipe.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Tokenizer + generation_config.json dir (with --engine; default <engine>/checkpoint).",
)
@click.option(
    "--out", type=click.Path(path_type=Path), help="Output dir (default: triton.repo_dir, else the build artifact)."
)
def repo(recipe: Path, overrides, engine_dir, tokenizer_dir, out) -> None:
    """Write the Triton model repository: build the recipe up to the repo stage, or from --engine."""
    from trtpipe.app.launch_triton import write_repository

    click.echo(write_repository(recipe, overrides, engine_dir, tokenizer_dir, out))
