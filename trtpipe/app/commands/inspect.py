"""``trtpipe inspect``: summarize an HF model directory or a TensorRT-LLM checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def inspect(path: Path, as_json: bool) -> None:
    """Summarize an HF model directory or a TensorRT-LLM checkpoint (dims, quantization, per-rank tensors)."""
    from trtpipe.app.inspection import format_summary, inspect_path

    summary = inspect_path(path)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
