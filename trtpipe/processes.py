"""OS-process helpers that every launcher (tritonserver in ``trtpipe.triton.server_process``, the leader-mode
supervisor in ``trtpipe.triton.mpi_launch``, the OpenAI twin, Dynamo, the servers ``batch`` starts, trtllm-build)
and the CLI share: the one place a process is started (:func:`spawn`: its log, its session, dying with its parent),
tell whether a pid still runs, show a log's tail, remove a server's shared-memory files, read and write the small
JSON state files, and turn SIGTERM into Ctrl-C.

They live apart from both launchers so that neither has to import the other for them (the leader mode builds on
the single server, one way: rank 0 is that server).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence
from trtpipe.jsonfile import load_json

SHM_DIR = Path("/dev/shm")
LOG_TAIL_LINES = 25


def cache_dir() -> Path:
    """Where trtpipe keeps its tritonserver copy, server logs, detached servers' state files and leader-mode run
    dirs (``$TRTPIPE_CACHE``, default ``~/.cache/trtpipe``)."""
    return Path(os.environ.get("TRTPIPE_CACHE", Path.home() / ".cache" / "trtpipe"))


Child = subprocess.Popen  # the handle spawn returns: pid, poll(), wait(timeout), send_signal(), kill()
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> Callable[[], None]:
    """In the child before exec: SIGTERM it when ``parent`` dies, even by SIGKILL (``PR_SET_PDEATHSIG``); a
    parent already gone before the prctl would send nothing, so the child exits at once."""

    def pre_exec() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(1)

    return pre_exec


def spawn(
    cmd: Sequence[str],
    log: Optional[Path],
    env: Optional[dict] = None,
    cwd: Optional[Path] = None,
    *,
    session: bool = True,
    die_with_parent: bool = False,
    truncate: bool = False,
    header: bool = False,
) -> Child:
    """Start ``cmd``, the one way every launcher does (tritonserver, the MPI job and its launcher, the OpenAI
    twin, Dynamo's processes, a python stub's watchdog): stdin closed, stdout and stderr appended to ``log``
    (``truncate``: a fresh log; ``header``: the command line first; None: this process's own streams).

    ``session``: a session (and process group) of its own, so a Ctrl-C in our terminal is ours to handle, not its,
    and a teardown can signal its whole group. ``die_with_parent``: it gets SIGTERM when we die, even by SIGKILL,
    so a server started for one job never outlives the job.
    """
    pre_exec = _die_with_parent(os.getpid()) if die_with_parent else None
    if log is None:
        return subprocess.Popen(
            list(cmd), stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=session, preexec_fn=pre_exec
        )
    with open(log, "wb" if truncate else "ab") as fh:
        if header:
            fh.write(f"# {' '.join(map(str, cmd))}\n".encode())
            fh.flush()
        return subprocess.Popen(
            list(cmd),
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=session,
            preexec_fn=pre_exec,
        )


def spawn_reader(cmd: Sequence[str], cwd: Optional[Path] = None) -> Child:
    """Start ``cmd`` with its output (stderr too) for the caller to read line by line (``child.stdout``, text):
    a tool whose progress we log as it runs (trtllm-build)."""
    return subprocess.Popen(
        list(cmd),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
    )


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


def process_start_time(pid: Optional[int]) -> Optional[float]:
    """When ``pid`` started (psutil ``create_time``, seconds since the epoch), or None when no such process runs
    or it cannot be read. A pid is reused; (pid, start time) names one process."""
    if not pid:
        return None
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: Optional[int], started: Optional[float]) -> bool:
    """True while the process recorded as (``pid``, ``started``) runs: the pid is alive and started then (not a
    later process that reuses the pid). A record without a start time cannot be told apart: False."""
    return started is not None and pid_alive(pid) and process_start_time(pid) == started


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, for an error message (``(no log)`` when it cannot be read)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def clean_shm(prefix: str) -> list[str]:
    """Remove the shared-memory files named ``prefix*`` (a killed python-backend stub leaves its regions behind);
    return the names removed. An empty prefix names none (a server without python stubs has no prefix: it must not
    take every region in ``/dev/shm``, other servers' included)."""
    return remove_files(SHM_DIR.glob(f"{prefix}*")) if prefix else []


def remove_files(paths: Iterable[Path]) -> list[str]:
    """Unlink each path that can be unlinked (one already gone or not ours is skipped); return the names removed."""
    removed = []
    for p in paths:
        try:
            p.unlink()
            removed.append(p.name)
        except OSError:
            pass
    return removed


def read_state(path: Path) -> Optional[Any]:
    """A state file's JSON, or None while it is missing, half-written by an older version, or not JSON."""
    try:
        return load_json(Path(path))
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


RUN_DIR_ENV = "TRTPIPE_MPI_RUN_DIR"  # set by the leader-mode launch (triton/mpi_launch.py); rank 0 reports there
DRAFT_DIR_ENV = "TRTPIPE_MPI_DRAFT_DIR"  # the two-model form's draft engine dir under leader mode (draft_proxy)
EXIT_RECORD_ENV = "TRTPIPE_EXIT_RECORD"  # where a process that ends by itself writes why (a rank's ``rank{N}.exit``)


def record_exit(reason: str) -> None:
    """One line saying why this process is ending by itself (a worker rank whose leader is gone, or that was told to
    stop), at ``$TRTPIPE_EXIT_RECORD``. A dead rank without one was killed or crashed: the one the job lost first."""
    path = os.environ.get(EXIT_RECORD_ENV)
    if path:
        try:
            Path(path).write_text((reason.strip().splitlines() or [""])[0][:500] + "\n")
        except OSError:
            pass
