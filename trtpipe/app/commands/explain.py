"""``trtpipe explain``: the fully resolved recipe, every default shown."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Plain JSON instead of annotated YAML.")
def explain(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print the fully resolved recipe, every default shown and marked."""
    from trtpipe.recipe.describe import explain as explain_recipe
    from trtpipe.app.validation import load_recipe

    click.echo(explain_recipe(load_recipe(recipe, overrides), as_json=as_json), nl=False)
