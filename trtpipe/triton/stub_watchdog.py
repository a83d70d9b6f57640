"""End a python-backend stub when its tritonserver dies (kill -9, OOM killer), from a separate process.

A stub cannot reliably watch its own parent: on the python backend of tritonserver 2.51, a response
``send`` to a dead server blocks forever *holding the GIL*, so no Python thread of the stub (a watchdog
thread included) ever runs again, and the stub keeps its memory and its threads after the server is gone.
``PR_SET_PDEATHSIG`` does not help either: it fires when the server *thread* that spawned the stub exits,
which tritonserver's model-loading threads do while the server lives on.

So each stub starts this module as a small child process (``python -m trtpipe.triton.stub_watchdog STUB
SERVER``). It holds pidfds of both and sleeps in ``poll``: when the server exits, the stub has ``GRACE_S``
to end by itself (a normal shutdown may still be running its finalize), then gets SIGKILL; when the stub exits
first (a normal unload or shutdown) the watchdog just ends. pidfds make this exact: no
polling interval and no chance of signalling a reused pid.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from trtpipe.processes import Child, spawn

PYTHON_ENV = "TRTPIPE_PYTHON"  # set by ``trtpipe serve``: the interpreter that runs the watchdog
GRACE_S = 5.0  # how long a stub may outlive its server before the kill


def _python() -> Optional[str]:
    """An interpreter to run the watchdog: a stub's own ``sys.executable`` is the stub binary, not Python."""
    for candidate in (os.environ.get(PYTHON_ENV), sys.executable, shutil.which("python3")):
        if candidate and Path(candidate).name.startswith("python") and os.access(candidate, os.X_OK):
            return candidate
    return None


def start(server_pid: Optional[int] = None) -> Optional[Child]:
    """From a stub: start its watchdog (the server is the stub's parent). None when no Python can be found."""
    python = _python()
    if python is None:
        return None
    server = os.getppid() if server_pid is None else server_pid
    # close_fds (spawn's default): it holds none of the stub's pipes or shm descriptors
    return spawn([python, "-m", __name__, str(os.getpid()), str(server)], None, session=False)


def _parent_of(pid: int) -> Optional[int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces


def watch(stub: int, server: int) -> str:
    """Block until the stub or the server exits; kill the stub if the server went first. Returns what happened.

    Run as the stub's child: while our parent is ``stub``, that pid is the stub and cannot be reused."""
    try:
        stub_fd = os.pidfd_open(stub)
    except OSError:  # no pidfds (Linux < 5.3): poll instead
        return _watch_by_polling(stub, server)
    if os.getppid() != stub:
        return "stub exited"
    try:
        server_fd = os.pidfd_open(server)
    except ProcessLookupError:
        server_fd = None
    poller = select.poll()
    poller.register(stub_fd, select.POLLIN)
    if server_fd is not None and _parent_of(stub) == server:  # the pidfd is the stub's server, not a reused pid
        poller.register(server_fd, select.POLLIN)
        if stub_fd in {fd for fd, _ in poller.poll()}:
            return "stub exited"
        poller.unregister(server_fd)
    # The server is gone. On a normal shutdown the stub is finishing its finalize (a leader-mode twin releases
    # its MPI ranks there): give it a moment before the kill, which is for stubs that can no longer run.
    if poller.poll(int(GRACE_S * 1000)):
        return "stub exited"
    try:
        signal.pidfd_send_signal(stub_fd, signal.SIGKILL)
    except ProcessLookupError:
        return "stub exited"
    return "server died: stub killed"


def _watch_by_polling(stub: int, server: int, period: float = 0.2) -> str:
    while os.getppid() == stub:
        if _parent_of(stub) != server:
            deadline = time.monotonic() + GRACE_S
            while os.getppid() == stub and time.monotonic() < deadline:
                time.sleep(period)
            if os.getppid() != stub:
                return "stub exited"
            os.kill(stub, signal.SIGKILL)
            return "server died: stub killed"
        time.sleep(period)
    return "stub exited"


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the server, which stops us
    stub, server = (int(a) for a in argv)
    if os.getppid() != stub:  # started by someone else: nothing of ours to guard
        return 2
    watch(stub, server)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
