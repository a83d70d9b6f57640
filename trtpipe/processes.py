"""OS-process helpers that the single-server launch (``trtpipe.triton.server_process``), the leader-mode supervisor
(``trtpipe.triton.mpi_launch``) and the CLI share: start a detached process with its log, tell whether a pid still
runs, show a log's tail, remove a server's shared-memory files, read and write the small JSON state files, and turn
SIGTERM into Ctrl-C.

They live apart from both launchers so that neither has to import the other for them (the leader mode builds on
the single server, one way: rank 0 is that server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

SHM_DIR = Path("/dev/shm")
LOG_TAIL_LINES = 25


def cache_dir() -> Path:
    """Where trtpipe keeps its tritonserver copy, server logs, detached servers' state files and leader-mode run
    dirs (``$TRTPIPE_CACHE``, default ``~/.cache/trtpipe``)."""
    return Path(os.environ.get("TRTPIPE_CACHE", Path.home() / ".cache" / "trtpipe"))


def spawn(cmd: Sequence[str], log: Path, env: Optional[dict] = None, cwd: Optional[Path] = None) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (a Ctrl-C in our terminal is ours to handle, not its), stdin closed,
    stdout and stderr appended to ``log``."""
    with open(log, "ab") as fh:
        return subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)


def pid_alive(pid: Optional[int]) -> bool:
    """True while ``pid`` runs; a zombie counts as gone (and is reaped when it is our own child); None is not a pid."""
    if not pid:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, for an error message (``(no log)`` when it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def clean_shm(prefix: str) -> list[str]:
    """Remove the shared-memory files named ``prefix*`` (a killed python-backend stub leaves its regions behind);
    return the names removed."""
    removed = []
    for p in SHM_DIR.glob(f"{prefix}*"):
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed


def read_state(path: Path) -> Optional[Any]:
    """A state file's JSON, or None while it is missing, half-written by an older version, or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_state(path: Path, data: Any) -> None:
    """Write a state file atomically (a reader never sees half of it)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def sigterm_as_interrupt() -> None:
    """Make SIGTERM behave like Ctrl-C (``KeyboardInterrupt``), so a ``kill`` cleans up the way Ctrl-C does: a build
    removes its temporary artifacts, a server we started is stopped (it runs in a session of its own and would
    outlive us). Only the main thread may set signal handlers; elsewhere (a CLI embedded in a test) this does
    nothing."""

    def _term(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _term)
