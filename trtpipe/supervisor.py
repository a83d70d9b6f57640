"""The one process-group supervisor: start a server process, probe its readiness, record it in a state file, tear
it down; every launcher uses it (tritonserver in :mod:`trtpipe.triton.server_process`, the MPI leader-mode supervisor
in :mod:`trtpipe.triton.mpi_launch`, the OpenAI twin, Dynamo, the servers ``batch`` starts).

A :class:`Server` is one such process (a session and process group of its own, started by
:func:`trtpipe.processes.spawn`): ``ready()`` asks the endpoint its kind answers on (``READY_PATHS``), ``stop()``
sends SIGTERM, waits, and SIGKILLs its process group when it hangs, then removes its shared-memory files and state
file; ``detach()`` records it where ``trtpipe stop`` finds it (one state file per served directory, whichever
launcher started it) with its pid, start time (psutil ``create_time``) and command line; a server found through
that file is the recorded process only while the pid's start time matches (pids are reused), and a process that
does not match is never signalled. :func:`start` spawns one and waits until it is ready, exits, or runs out of time, never
leaving a process behind that nothing can find.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.processes import (
    Child,
    cache_dir,
    clean_shm,
    pid_alive,
    process_start_time,
    read_state,
    same_process,
    spawn,
    write_state,
)

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (the caller retries on 'already in use')."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Ports:
    http: int
    grpc: int
    metrics: int


# The readiness endpoint of each kind of server ``trtpipe serve`` starts: tritonserver, or the OpenAI twin of
# trtllm-serve (``trtpipe.app.launch_openai``, a ``target: llmapi`` recipe).
READY_PATHS = {"tritonserver": "/v2/health/ready", "openai": "/health", "dynamo": "/v1/models"}


def http_ready(http_url: str, path: str = READY_PATHS["tritonserver"]) -> bool:
    """True when the server at ``http_url`` answers ``path`` with 200 (tritonserver: every model loaded)."""
    try:
        with urllib.request.urlopen(f"{http_url}{path}", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def listed_models(http_url: str) -> list[str]:
    """The model ids an OpenAI server lists at ``/v1/models`` (none when it does not answer)."""
    try:
        with urllib.request.urlopen(f"{http_url}/v1/models", timeout=2) as r:
            return [m.get("id") for m in json.loads(r.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError):
        return []


@dataclass
class Server:
    """A running server we started (or found through its state file, for ``trtpipe stop``): a tritonserver on
    a model repository, or (``kind="openai"``) the OpenAI twin on an llmapi export (``repo`` is its model dir)."""

    pid: int
    repo: str
    bind: str
    ports: Ports
    log: str
    shm_prefix: str
    state_file: Optional[str] = None
    kind: str = "tritonserver"  # a key of READY_PATHS
    # which process ``pid`` is: its start time (psutil create_time) and command line, recorded by ``detach``; a
    # server found through a state file is alive only while that pid is still that process (pids are reused)
    started: Optional[float] = None
    cmdline: Optional[list[str]] = None
    # the Child when this process started it (None when found through a state file): its exit status names the cause
    process: Optional[Child] = field(default=None, repr=False, compare=False)
    run_dir: Optional[Path] = field(default=None, compare=False)  # a leader-mode job's run dir (mpi_launch)
    # the header that opens its restricted admin APIs (tritonserver we started; never in the state file)
    admin_headers: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def http_url(self) -> str:
        return f"http://{self.bind}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.bind}:{self.ports.grpc}"

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return same_process(self.pid, self.started)

    def ready(self) -> bool:
        if self.kind == "dynamo":  # Dynamo's frontend answers /health before any worker exists: a listed model is
            return bool(listed_models(self.http_url))  # what says it can serve
        return http_ready(self.http_url, READY_PATHS[self.kind])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait, SIGKILL if it hangs; then clean our shm regions and the state file. A process that now
        holds a recorded pid but is not the one recorded is never signalled, nor are the regions named after it."""
        ours = self.alive()
        if ours:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except OSError:
                pass
            deadline = time.monotonic() + timeout
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.alive():
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except OSError:
                    os.kill(self.pid, signal.SIGKILL)
                if self.process is not None:
                    self.process.wait(10)
                deadline = time.monotonic() + 10  # a child of ours stays a zombie until reaped (alive() reaps it)
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.1)
        if ours or not pid_alive(self.pid):  # a stranger holding the pid may use a prefix with that pid
            clean_shm(self.shm_prefix)
        if self.state_file:
            Path(self.state_file).unlink(missing_ok=True)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def detach(self, state_file: Path) -> None:
        """Record this server in ``state_file`` (``trtpipe stop`` and :func:`detached_servers` find it there);
        stop it when that fails, so no server runs that nothing can find."""
        try:
            state_file.parent.mkdir(parents=True, exist_ok=True)
            self.state_file = str(state_file)
            if self.process is not None:  # our unreaped child: the pid cannot have been reused yet
                self.started = process_start_time(self.pid)
                args = self.process.args
                self.cmdline = [str(args)] if isinstance(args, (str, bytes, os.PathLike)) else [str(a) for a in args]
            keys = ("pid", "started", "cmdline", "repo", "bind", "log", "shm_prefix", "state_file", "kind")
            d = {k: getattr(self, k) for k in keys}
            write_state(state_file, {**d, "ports": asdict(self.ports)})
        except BaseException:
            self.stop()
            raise


def state_dir() -> Path:
    return cache_dir() / "servers"


def state_path(repo: Path) -> Path:
    """The state file of the detached server of ``repo`` (one per repository, whichever launcher started it)."""
    return state_dir() / (hashlib.sha256(str(Path(repo).resolve()).encode()).hexdigest()[:16] + ".json")


def refuse_if_served(repo: Path) -> Path:
    """Raise when a live detached server already serves ``repo``; return the state file a new one would use."""
    state = state_path(repo)
    old = load_state(state) if state.exists() else None
    if old is not None and old.alive():
        raise ServingError(f"{repo}: already served by pid {old.pid} at {old.http_url} (trtpipe stop {repo})")
    return state


def wait_ready(server: Server, deadline: float) -> bool:
    """Poll readiness until ``deadline``; False when the process exited or time ran out."""
    while time.monotonic() < deadline:
        if not server.alive():
            return False
        if server.ready():
            return True
        time.sleep(0.25)
    return False


def load_state(path: Path) -> Optional[Server]:
    """The server a state file records (None when the file is missing or unreadable)."""
    d = read_state(path)
    if not isinstance(d, dict):
        return None
    d["ports"] = Ports(**d["ports"])
    return Server(**d)


def detached_servers() -> list[Server]:
    """Servers started with ``detach`` that still have a state file (stale files of dead servers are removed)."""
    found = []
    for p in sorted(state_dir().glob("*.json")) if state_dir().is_dir() else []:
        s = load_state(p)
        if s is None or not s.alive():
            p.unlink(missing_ok=True)
            if s is not None and not pid_alive(s.pid):  # not a stranger's regions (the prefix names the pid)
                clean_shm(s.shm_prefix)
            continue
        found.append(s)
    return found


def start(
    cmd: Sequence[str],
    log: Path,
    repo: Path,
    bind: str,
    ports: Ports,
    kind: str,
    shm_prefix: str = "",
    env: Optional[dict] = None,
    cwd: Optional[Path] = None,
    truncate: bool = False,
    die_with_parent: bool = False,
    run_dir: Optional[Path] = None,
) -> Server:
    """Spawn ``cmd`` as a :class:`Server` of ``kind`` (``shm_prefix`` may name ``{pid}``); it is not ready yet."""
    proc = spawn(cmd, log, env=env, cwd=cwd, truncate=truncate, die_with_parent=die_with_parent)
    return Server(
        proc.pid,
        str(repo),
        bind,
        ports,
        str(log),
        shm_prefix.format(pid=proc.pid),
        kind=kind,
        process=proc,
        run_dir=run_dir,
    )


def await_ready(server: Server, timeout: float, ready: Optional[Callable[[], bool]] = None) -> Optional[str]:
    """Wait until ``server`` is ready (``ready``, default its own probe): None, or why not ('exited during
    start-up', 'not ready after N s'), having stopped it. Ctrl-C while waiting stops it too."""
    ready = ready or server.ready
    deadline = time.monotonic() + timeout
    try:
        while server.alive() and not ready() and time.monotonic() < deadline:
            time.sleep(0.25)
        if ready():
            return None
        why = "exited during start-up" if not server.alive() else f"not ready after {timeout:.0f} s"
    except BaseException:
        server.stop()
        raise
    server.stop()
    return why


# --- several processes started together (Dynamo's frontend and workers) -----------------------------------------


def exit_cause(code: Optional[int]) -> str:
    """How a child ended, from its exit status (we are its parent: no guessing)."""
    if code is None:
        return "running"
    if code < 0:
        return (
            f"Killed (signal {-code}, {signal.Signals(-code).name})"
            if -code in signal.valid_signals()
            else f"killed by signal {-code}"
        )
    return f"exited with status {code}"


@dataclass
class Member:
    """One process of a group this process started and watches."""

    role: str  # e.g. "frontend", "worker0"
    proc: Child
    log: Path
    system_port: Optional[int] = None  # a port of its own besides the group's (a Dynamo worker's system server)
    cause: Optional[str] = None  # why it ended, once noticed

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def notice_end(self) -> bool:
        """True the first time it is seen ended (its cause then set), else False."""
        if self.cause is not None or self.alive():
            return False
        self.cause = exit_cause(self.proc.returncode)
        return True


def spawn_member(
    role: str, cmd: Sequence[str], log: Path, env: Optional[dict] = None, cwd: Optional[Path] = None
) -> Member:
    """Start one member in our own process group (a Ctrl-C reaches it too), its command line heading its log."""
    return Member(role, spawn(cmd, log, env=env, cwd=cwd, session=False, header=True), log)


def stop_in_order(groups: Sequence[Sequence[Member]], grace: float) -> None:
    """Group by group: SIGTERM every live member, wait up to ``grace`` for the group, SIGKILL what outlives it."""
    for group in groups:
        live = [m for m in group if m.alive()]
        for m in live:
            m.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for m in live:
            try:
                m.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(10)
