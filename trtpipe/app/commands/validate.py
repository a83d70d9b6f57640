"""``trtpipe validate``: check recipes (schema, cross-field and builder rules) without loading weights."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(path_type=Path))
@OVERRIDES
def validate(recipes: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Check recipes (schema and cross-field rules) without loading weights. Exit 2 on any error."""
    from trtpipe.errors import RecipeError
    from trtpipe.app.validation import load_recipe

    failed = False
    for path in recipes:
        try:
            load_recipe(path, overrides)
            click.echo(f"{path}: ok")
        except RecipeError as exc:
            click.echo(str(exc), err=True)
            failed = True
    if failed:
        sys.exit(RecipeError.exit_code)
