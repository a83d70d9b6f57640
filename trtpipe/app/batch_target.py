"""What a batch job sends to: a served URL as given, or a recipe served for the job alone and stopped after it.

A recipe (``target: llmapi``, or an HF checkpoint directory) is served by the OpenAI twin of trtllm-serve, as
``trtpipe serve`` would run it in the foreground (:func:`trtpipe.app.launch_openai.child_command`), on a free
loopback port, in a child process that dies with the job (``PR_SET_PDEATHSIG``): a job killed by SIGKILL leaves
no server behind, and its rerun starts a fresh one. It is not recorded for ``trtpipe stop``: nothing but this job
uses it. When it dies during the job, :meth:`JobServer.revive` starts it again on the same port (and the
job's health probe waits for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from trtpipe import supervisor
from trtpipe.batch.requests import BatchError
from trtpipe.processes import cache_dir, log_tail
from trtpipe.app.launch_openai import OpenAITarget, child_command, resolve_openai_target
from trtpipe.supervisor import READY_TIMEOUT_S, Ports, Server, free_ports


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


@dataclass
class JobServer:
    """The twin serving a recipe for one batch job."""

    target: OpenAITarget
    overrides: Sequence[str]
    timeout_s: float = READY_TIMEOUT_S
    server: Optional[Server] = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.target.host}:{self.target.port}"

    def spawn(self) -> None:
        """Start the server process (returns at once; :meth:`start` waits for it to answer)."""
        t = self.target
        log = cache_dir() / "logs" / f"batch-{t.name.replace('/', '_')}-{t.port}.openai.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.server = supervisor.start(
            child_command(t, self.overrides),
            log,
            t.model_dir,
            t.host,
            Ports(t.port, 0, 0),
            "openai",
            die_with_parent=True,
        )
        self.starts += 1

    def start(self) -> None:
        """Spawn and wait until ``/health`` answers; BatchError with the log's tail when it does not."""
        self.spawn()
        log = self.server.log
        why = supervisor.await_ready(self.server, self.timeout_s)
        if why:
            self.server = None
            raise BatchError(f"the OpenAI twin on {self.target.model_dir} {why}; log {log}:\n{log_tail(log)}")

    def revive(self) -> None:
        """Spawn the server again when it has died (a no-op while it runs); the caller's health probe waits for
        it, so the job keeps checkpointing meanwhile."""
        if self.server is None or not self.server.alive():
            self.spawn()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def job_server(target: str, overrides: Sequence[str], timeout_s: float = READY_TIMEOUT_S) -> JobServer:
    """Resolve (build up to the export, cached stages reused) and start the server of a recipe or model dir."""
    path = Path(target)
    if not path.exists():
        raise BatchError(f"{target}: no such recipe or model directory (or give a URL, http://HOST:PORT)")
    t = resolve_openai_target(path, overrides, host="127.0.0.1", port=free_ports(1)[0])
    server = JobServer(t, overrides, timeout_s)
    server.start()
    return server
