"""``trtpipe serve``: serve any target (Triton repository, engine recipe, llmapi recipe, Dynamo)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES


@click.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@OVERRIDES
@click.option(
    "--bind",
    "--host",
    "bind",
    default=None,
    help="Address of all endpoints (default: recipe triton.bind or llmapi.host, else 127.0.0.1).",
)
@click.option(
    "--http-port",
    "--port",
    "http_port",
    type=int,
    help="HTTP port (llmapi target: the OpenAI API's, default llmapi.port).",
)
@click.option("--grpc-port", type=int)
@click.option("--metrics-port", type=int)
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--detach", is_flag=True, help="Return once ready; stop it later with trtpipe stop.")
@click.option("--dry-run", is_flag=True, help="Print the launch command (mpirun leader mode for TensorRT engines).")
@click.option(
    "--tritonserver",
    default="/opt/tritonserver/bin/tritonserver",
    show_default=True,
    help="tritonserver binary of the TensorRT-LLM container (TensorRT engines).",
)
@click.option(
    "--hostfile",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="MPI hostfile (host:slots per line) for a multi-node leader-mode launch.",
)
@click.option(
    "--single-process",
    is_flag=True,
    help="CPU twin of a tp/pp>1 repository: run every rank's shard in one tritonserver (no MPI).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="llmapi target: the model name clients send (default: recipe llmapi.served_model_name, else its name).",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="llmapi target: Jinja chat template file, for tokenizers without one.",
)
@click.option(
    "--dynamo",
    is_flag=True,
    help="llmapi target: NVIDIA Dynamo's frontend and router in front of "
    "--replicas twin workers (Dynamo in its own venv: scripts/install_dynamo.sh).",
)
@click.option("--replicas", default=1, show_default=True, type=int, help="--dynamo: how many workers.")
@click.option(
    "--router",
    type=click.Choice(["kv", "round-robin"]),
    default="kv",
    show_default=True,
    help="--dynamo: the frontend's router mode (kv: to the worker holding the longest cached prefix).",
)
def serve(
    target: Path,
    overrides,
    bind,
    http_port,
    grpc_port,
    metrics_port,
    timeout,
    detach,
    dry_run,
    tritonserver,
    hostfile,
    single_process,
    served_model_name,
    chat_template,
    dynamo,
    replicas,
    router,
) -> None:
    """Serve any target; Ctrl-C stops it cleanly. A Triton model repository or an engine recipe (built first if
    needed) runs on tritonserver; a target: llmapi recipe (or an HF checkpoint dir) on the OpenAI-compatible
    twin of trtllm-serve. serve-openai is another name of this command (--host / --port name --bind /
    --http-port)."""
    from trtpipe.app.launch_openai import is_openai_target, serve_openai
    from trtpipe.app.launch_triton import serve_repository

    if is_openai_target(target, overrides):
        triton_only = {
            "--grpc-port": grpc_port,
            "--metrics-port": metrics_port,
            "--dry-run": dry_run,
            "--hostfile": hostfile,
            "--single-process": single_process,
        }
        if any(triton_only.values()):
            raise click.UsageError(
                f"{', '.join(k for k, v in triton_only.items() if v)}: for Triton targets; {target} "
                "is served by the OpenAI twin (options: --bind, --http-port, --detach, --timeout)"
            )
        if dynamo:
            from trtpipe.app.launch_dynamo import serve_dynamo

            serve_dynamo(
                target,
                overrides,
                bind,
                http_port,
                served_model_name,
                replicas,
                router,
                chat_template,
                detach,
                timeout,
                click.echo,
            )
            return
        serve_openai(target, overrides, bind, http_port, served_model_name, chat_template, detach, timeout, click.echo)
        return
    if dynamo:
        raise click.UsageError(
            f"--dynamo: for target: llmapi recipes (Dynamo's TensorRT-LLM workers run the PyTorch "
            f"backend); {target} is a Triton target"
        )
    sys.exit(
        serve_repository(
            target,
            overrides,
            bind,
            http_port,
            grpc_port,
            metrics_port,
            timeout,
            detach,
            dry_run,
            tritonserver,
            hostfile,
            single_process,
            click.echo,
        )
    )
