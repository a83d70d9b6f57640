"""``trtpipe batch TARGET --input requests.jsonl --output results.jsonl``: one job, start to summary.

Read and check the input (nothing is sent when a line is bad), open the journal (recovering a killed run's files
and skipping what they hold), serve the target when it is a recipe, send the rest with a progress bar, and print
a summary. Exit status: 0 every request succeeded; 3 the job completed but some requests failed (the errors file
has them); 1 the server stayed unreachable, or 130 Ctrl-C / SIGTERM: the job stopped before the end, and the
same command resumes it; 2 bad input, or output files that are not this job's (or one file given two roles);
4 the disk filled: the job stopped, resumable once there is space.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpipe.batch.client import BatchClient, ClientOptions, RunStats
from trtpipe.batch.journal import Journal, default_errors_path, default_state_path
from trtpipe.batch.requests import BatchError, read_requests
from trtpipe.app.batch_target import is_url, job_server
from trtpipe.pipeline.progress import progress_bar

EXIT_OK, EXIT_STOPPED, EXIT_FAILED_REQUESTS = 0, 1, 3
MAX_CHECKPOINT_INTERVAL_S = 30.0


@dataclass
class BatchJob:
    target: str
    input: Path
    output: Path
    errors: Optional[Path] = None
    state: Optional[Path] = None
    overrides: Sequence[str] = ()
    options: ClientOptions = field(default_factory=ClientOptions)
    progress: bool = True
    server_timeout_s: float = 180.0
    retry_errors: bool = False  # send the errors file's requests again (the file is archived, not overwritten)


def summary(journal: Journal, stats: Optional[RunStats], resumed: int, elapsed_s: float, status: str) -> str:
    now = journal.written_now
    rate = now / elapsed_s if elapsed_s > 0 else 0.0
    lines = [
        f"batch {status}: {journal.done} of {journal.total} requests written "
        f"({journal.succeeded} succeeded, {journal.failed} failed); "
        f"this run {now} in {elapsed_s:.1f} s ({rate:.1f} req/s)"
        + (f", resumed after {resumed} already done" if resumed else "")
    ]
    if stats is not None:
        sending = journal.written_now / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
        lines.append(f"  sending: {stats.elapsed_s:.1f} s, {sending:.1f} req/s (the rest: serving the target)")
        lines.append(
            f"  sent {stats.sent}, retried {stats.retried}, overloaded (429/503) {stats.overloaded}, "
            f"connection losses {stats.connection_losses}, metric backoffs {stats.metrics_backoffs}, "
            f"completion tokens {stats.completion_tokens}"
        )
    if journal.torn:
        lines.append("  torn last line cut off: " + "; ".join(journal.torn))
    if journal.retried:
        lines.append(f"  retried {journal.retried} failed requests (earlier answers: {journal.retried_from})")
    lines.append(f"  output {journal.output}\n  errors {journal.errors}\n  state  {journal.state}")
    return "\n".join(lines)


def run_job(job: BatchJob, echo: Callable[[str], None], warn: Callable[[str], None]) -> int:
    """Run (or resume) the job; return the exit status (module docstring)."""
    if not 0 < job.options.checkpoint_interval_s <= MAX_CHECKPOINT_INTERVAL_S:
        raise BatchError(f"--checkpoint-interval must be in (0, {MAX_CHECKPOINT_INTERVAL_S:.0f}] s")
    requests = read_requests(job.input)
    journal = Journal(
        job.input,
        job.output,
        job.errors or default_errors_path(job.output),
        job.state or default_state_path(job.output),
        job.target,
    )
    done = journal.open(requests, job.retry_errors)
    t0 = time.monotonic()
    try:
        todo = [r for r in requests if r.custom_id not in done]
        if journal.torn:
            warn("recovered a torn last line (a killed run): " + "; ".join(journal.torn))
        if journal.retried:
            warn(
                f"retrying {journal.retried} failed requests; their earlier answers are kept in {journal.retried_from}"
            )
        stats = _send(job, journal, todo, len(done), warn) if todo else None
        journal.checkpoint("completed")
        echo(summary(journal, stats, len(done), time.monotonic() - t0, "completed"))
        return EXIT_FAILED_REQUESTS if journal.failed else EXIT_OK
    except BaseException as exc:
        stopped = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
        try:
            journal.checkpoint(stopped)
        except BatchError as checkpoint_exc:  # a full disk: the journal, not the state file, is the truth
            warn(str(checkpoint_exc))
        warn(summary(journal, None, len(done), time.monotonic() - t0, stopped))
        raise
    finally:
        journal.close()


def _send(job: BatchJob, journal: Journal, todo, resumed: int, warn) -> RunStats:
    server = None if is_url(job.target) else job_server(job.target, job.overrides, job.server_timeout_s)
    url = job.target if server is None else server.url
    try:
        with progress_bar(
            "batch", total=journal.total, disabled=not job.progress, unit="req", completed=resumed
        ) as bar:

            def on_window(in_flight: int, allowed: int) -> None:
                bar.update(description=f"batch [{in_flight}/{allowed} in flight]")

            client = BatchClient(
                url,
                journal,
                job.options,
                on_result=lambda ok: bar.advance(),
                say=warn,
                revive=server.revive if server else None,
                on_window=on_window,
            )
            return asyncio.run(client.run(todo))
    finally:
        if server is not None:
            server.stop()
