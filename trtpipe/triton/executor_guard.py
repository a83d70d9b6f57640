"""A dead executor ends its tritonserver, so the deployment turns unhealthy at once.

tritonserver 2.51 knows nothing of the python stub's executor thread: when that loop stops (anything no ``except
Exception`` holds: ``SystemExit``, ``KeyboardInterrupt``), ``/v2/health/ready`` and the model's ready endpoint stay
200 while every request is refused, and a stub that exits is restarted by the python backend with the model still
"ready". The python backend gives a model no way to mark itself unready either (no readiness call; model control
is the server's). What the server does allow is a shutdown: the stub sends its tritonserver SIGTERM, the server
stops answering ready at once (it is exiting), finishes within ``--exit-timeout-secs`` and exits, and whatever
supervises it (``trtpipe serve`` reports the exit with the log tail, an orchestrator restarts the pod) takes over.

``FAULT_ENV`` lets a chaos test end the loop for real in a served stub: ``exit-at-step:N`` makes step N raise
``SystemExit`` inside the executor thread (the real engine runs every other step).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

FAULT_ENV = "TRTPIPE_TWIN_FAULT"


class ExitAtStep:
    """The step engine, except that step ``n`` raises ``SystemExit`` (what an engine process gone would raise)."""

    def __init__(self, engine, n: int):
        self.engine, self.n = engine, n

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, batch):
        if batch.iteration >= self.n:
            raise SystemExit(f"{FAULT_ENV}: exit at step {self.n}")
        return self.engine.step(batch)


def with_fault(engine, spec: Optional[str] = None):
    """The engine wrapped as ``FAULT_ENV`` (or ``spec``) asks; unchanged when unset. ValueError names a bad value."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    if not spec:
        return engine
    kind, _, arg = spec.partition(":")
    if kind != "exit-at-step" or not arg.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected exit-at-step:N")
    return ExitAtStep(engine, int(arg))


def guard(
    executor, log_error: Callable[[str], None], server_pid: Optional[int] = None, sig: int = signal.SIGTERM
) -> threading.Thread:
    """Watch ``executor`` from a daemon thread: once its loop stops for any reason but a shutdown, log why and send
    ``sig`` to the server (the stub's parent). Returns the thread (it ends when the loop does)."""
    server = os.getppid() if server_pid is None else server_pid

    def watch() -> None:
        executor.stopped.wait()
        why = executor.stopped_because
        if why == "shut down":
            return
        log_error(
            f"tensorrt_llm twin: {why}; stopping tritonserver (pid {server}) so the deployment turns "
            f"unhealthy and is restarted"
        )
        try:
            os.kill(server, sig)
        except ProcessLookupError:
            pass

    t = threading.Thread(target=watch, name="trtpipe-executor-guard", daemon=True)
    t.start()
    return t
