"""``trtpipe infer``: ask the served model one prompt."""

from __future__ import annotations

import click

from trtpipe.app.options import gen_options


@click.command()
@click.argument("prompt")
@gen_options
@click.option("--stream", is_flag=True, help="Print the answer as it is generated (gRPC, decoupled repository).")
def infer(prompt, url, server, overrides, protocol, model, max_tokens, temperature, top_k, top_p, seed, stream) -> None:
    """Ask the served model PROMPT and print the answer."""
    from trtpipe.triton.client import Client, GenerateOptions
    from trtpipe.app.launch_triton import client_url

    opts = GenerateOptions(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with Client(client_url(url, protocol, server, overrides), protocol, model) as client:
        if stream:
            for piece in client.stream(prompt, opts):
                click.echo(piece, nl=False)
            click.echo()
        else:
            click.echo(client.generate(prompt, opts))
