"""``trtpipe doctor``: the host's versions checked against an engine."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.command()
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, exists=True, path_type=Path))
def doctor(engine_dir) -> None:
    """Check python, torch, GPU, driver, CUDA, TensorRT, TensorRT-LLM, MPI and tritonserver (against ENGINE_DIR)."""
    from trtpipe.engine import doctor as doc

    checks = doc.diagnose(engine_dir)
    click.echo(doc.render(checks, engine_dir))
    if doc.failed(checks):
        sys.exit(1)
