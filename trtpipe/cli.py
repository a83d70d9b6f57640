"""The ``trtpipe`` command line: a thin click layer; each command parses, calls one library function, prints.

Commands are grouped by area in marked sections below. Imports of heavy modules (torch, tritonclient)
happen inside commands so ``trtpipe validate`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtpipe import __version__
from trtpipe.errors import TrtpipeError


def _fail(exc: TrtpipeError) -> None:
    click.echo(str(exc), err=True)
    sys.exit(exc.exit_code)


class _Group(click.Group):
    """Turns every TrtpipeError into its one-line message and exit code (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtpipeError as exc:
            _fail(exc)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtpipe")
def main() -> None:
    """Build and deploy LLMs on TensorRT-LLM and Triton from one YAML recipe."""


OVERRIDES = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key, e.g. --set parallel.tp=2."
)


# --- recipe commands -------------------------------------------------------------------------------


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
def validate(recipes: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Check recipes (schema and cross-field rules) without loading weights. Exit 2 on any error."""
    from trtpipe.errors import RecipeError
    from trtpipe.recipe import load_recipe

    failed = False
    for path in recipes:
        try:
            load_recipe(path, overrides)
            click.echo(f"{path}: ok")
        except RecipeError as exc:
            click.echo(str(exc), err=True)
            failed = True
    if failed:
        sys.exit(2)


@main.command()
def schema() -> None:
    """Print the recipe JSON Schema (for editor completion)."""
    from trtpipe.recipe.schema import Recipe

    click.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="JSON instead of YAML.")
def explain(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print the fully resolved recipe, every default shown."""
    import yaml

    from trtpipe.recipe import load_recipe

    data = load_recipe(recipe, overrides).model_dump(mode="json")
    click.echo(json.dumps(data, indent=2) if as_json else yaml.safe_dump(data, sort_keys=False))


# --- build pipeline commands -----------------------------------------------------------------------

# --- checkpoint commands (convert, inspect, generate) ----------------------------------------------

# --- quantization commands (calibrate, quantize, eval) ---------------------------------------------

# --- engine commands (plan, engine, doctor) --------------------------------------------------------

# --- triton commands (repo, serve, stop, infer, bench) ---------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    main()
