"""``trtpipe engine``: the trtllm-build command and build_config; with ``--out``, build."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import CHECKPOINT, MODEL_CONFIG, OVERRIDES


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@MODEL_CONFIG
@CHECKPOINT
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Build into this (empty) directory: TensorRT engines, or the CPU twin without TensorRT-LLM.",
)
def engine(recipe, overrides, gpu, model_config, checkpoint, out) -> None:
    """Print the trtllm-build command and build_config JSON; with --checkpoint and --out, build."""
    import logging

    from trtpipe.app import planning

    r = planning.resolve(recipe, overrides, gpu=gpu, model_config=model_config, checkpoint=checkpoint)
    if out is None:
        click.echo(planning.render_build(r))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = planning.build_engine(r, out, logging.getLogger("trtpipe.engine"))
    click.echo(f"{out}: {info['engine']} engine")
