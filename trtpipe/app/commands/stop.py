"""``trtpipe stop``: stop servers started with ``serve --detach``."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("target", required=False, type=click.Path(exists=True, path_type=Path))
@OVERRIDES
def stop(target, overrides) -> None:
    """Stop servers started with serve --detach (TARGET: repository, recipe or model dir; default: the only one)."""
    from trtpipe.app.launch_triton import stop_servers

    stop_servers(target, overrides, click.echo)
