"""``trtpipe generate``: text from a TensorRT-LLM checkpoint on the CPU reference runtime."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("ckpt_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
def generate(ckpt_dir, prompt, max_tokens, tokenizer_dir, temperature, top_k, top_p, seed) -> None:
    """Generate text with the CPU reference runtime from a TensorRT-LLM checkpoint (streams to stdout)."""
    from trtpipe.runtime.text import stream_text

    stream_text(
        ckpt_dir,
        prompt,
        max_tokens,
        tokenizer_dir,
        temperature,
        top_k,
        top_p,
        seed,
        write=lambda text: click.echo(text, nl=False),
    )
