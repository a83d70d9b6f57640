"""``trtpipe batch``: an OpenAI Batch file against a served URL or a recipe served for the job."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, priority_value


@click.command()
@click.argument("target")
@OVERRIDES
@click.option(
    "--input",
    "-i",
    "input_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="OpenAI Batch input JSONL: one {custom_id, method, url, body} per line.",
)
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Results JSONL (appended; rerunning with it resumes the job).",
)
@click.option(
    "--errors",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Failed requests JSONL (default: OUTPUT's name with .errors before the suffix).",
)
@click.option(
    "--state", type=click.Path(dir_okay=False, path_type=Path), help="State file (default: OUTPUT.state.json)."
)
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1, 4096),
    default=8,
    show_default=True,
    help="Most requests in flight (less while the server reports pressure).",
)
@click.option(
    "--priority",
    callback=priority_value,
    default="0.0",
    show_default=True,
    help="OpenAI 'priority' sent with each request, in [0, 1], higher first (trtllm-serve's default is "
    "0.5); 'none': not sent.",
)
@click.option(
    "--max-retries",
    type=click.IntRange(0, 100),
    default=5,
    show_default=True,
    help="Tries after the first for 5xx answers and lost connections (429/503 are always retried).",
)
@click.option(
    "--request-timeout", type=click.FloatRange(1), default=600.0, show_default=True, help="Seconds per request."
)
@click.option(
    "--server-wait",
    type=click.FloatRange(0),
    default=300.0,
    show_default=True,
    help="Seconds the server may be unreachable before the job stops (resumable).",
)
@click.option(
    "--checkpoint-interval",
    type=click.FloatRange(0.1, 30),
    default=10.0,
    show_default=True,
    help="Seconds between state-file checkpoints.",
)
@click.option(
    "--metrics-interval",
    type=click.FloatRange(0),
    default=2.0,
    show_default=True,
    help="Seconds between reads of the server's Prometheus metrics (0: only 429/503 slow the job).",
)
@click.option(
    "--retry-errors",
    is_flag=True,
    help="Send the errors file's requests again; the file is first renamed to ERRORS.retried-N.jsonl.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (the summary is still printed).")
def batch(
    target,
    overrides,
    input_path,
    output,
    errors,
    state,
    concurrency,
    priority,
    max_retries,
    request_timeout,
    server_wait,
    checkpoint_interval,
    metrics_interval,
    retry_errors,
    no_progress,
) -> None:
    """Run an OpenAI Batch file against TARGET: a served URL (http://HOST:PORT), or a target: llmapi recipe (or
    HF directory) served for the job and stopped after it. Killed at any moment, the same command resumes:
    each custom_id is written exactly once. Exit 0 all succeeded, 3 some failed (see the errors file), 1 the
    server stayed unreachable, 130 interrupted (both resumable), 2 bad input (or one file in two of the roles
    input, output, errors, state), 4 the disk filled (resumable once there is space)."""
    from trtpipe.batch.client import ClientOptions
    from trtpipe.app.batch_job import BatchJob, run_job
    from trtpipe.processes import sigterm_as_interrupt

    opts = ClientOptions(
        concurrency=concurrency,
        priority=priority,
        max_retries=max_retries,
        request_timeout_s=request_timeout,
        server_wait_s=server_wait,
        metrics_interval_s=metrics_interval,
        checkpoint_interval_s=checkpoint_interval,
    )
    job = BatchJob(
        target, input_path, output, errors, state, overrides, opts, progress=not no_progress, retry_errors=retry_errors
    )
    sigterm_as_interrupt()
    sys.exit(run_job(job, click.echo, lambda line: click.echo(line, err=True)))
