"""``trtpipe schema``: the recipe's JSON Schema, or its reference as Markdown."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--markdown", is_flag=True, help="The recipe reference as Markdown tables instead (recipes/README.md).")
def schema(markdown: bool) -> None:
    """Print the recipe JSON Schema (for editor completion)."""
    from trtpipe.recipe.describe import recipe_json_schema, reference_markdown

    click.echo(reference_markdown() if markdown else json.dumps(recipe_json_schema(), indent=2), nl=not markdown)
