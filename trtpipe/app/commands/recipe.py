"""``trtpipe recipe``: tools that write recipes (``import``: from one of NVIDIA's per-model serving configs)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click


@click.group()
def recipe() -> None:
    """Write recipes from other tools' configs."""


@recipe.command("import")
@click.argument("database_yaml", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Recipe file to write (default: stdout).")
@click.option("--source", help="Where the YAML came from (e.g. its repository path@commit), kept in the header.")
@click.option("--model", help="model.source (default: hf://<org>/<model> from the path).")
def import_(database_yaml: Path, out: Optional[Path], source: Optional[str], model: Optional[str]) -> None:
    """Make a recipe from NVIDIA/TensorRT-LLM examples/configs/database/<org>/<model>/<gpu>/<isl><osl>_tp<N>_conc<C>.yaml."""
    from trtpipe.app.recipe_import import import_recipe

    text = import_recipe(database_yaml, source, model)  # refuses (one line) before anything is written
    if out is None:
        click.echo(text, nl=False)
        return
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    click.echo(f"wrote {out}")
