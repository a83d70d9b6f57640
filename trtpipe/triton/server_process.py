"""Start, watch and stop a real ``tritonserver``; find it again through its state file (``trtpipe stop``).

Policy (docs/reference/cpu-environment.md): the CPU server is the tritonserver 2.51 shipped inside nvidia-pytriton,
copied once into a cache directory of our own (never named ``triton``: that would shadow OpenAI Triton in
the models' imports), with the python-backend stub of this interpreter's version beside the backend. The
stub runs Python isolated, so it finds this venv's packages through ``PATH`` (venv ``bin`` first), and it
needs this interpreter's ``LIBDIR`` on ``LD_LIBRARY_PATH``. Port 0 does not work in tritonserver, so we pick
free ports and retry when one is taken in between. Every launch gets its own python-backend shared-memory
prefix so that cleaning ``/dev/shm`` after a stop only touches our own regions. The leader-mode launch
(:mod:`trtpipe.triton.mpi_launch`) builds on this module (its rank 0 is this server); the process helpers both
use are in :mod:`trtpipe.processes`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from trtpipe.errors import ServingError
from trtpipe.extras import require
from trtpipe.processes import cache_dir, clean_shm, log_tail, pid_alive, read_state, spawn, write_state
from trtpipe.triton import stub_watchdog

READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 5  # how long tritonserver waits for open connections / in-flight requests on SIGTERM


def _pytriton_server_dir() -> Path:
    pytriton = require("pytriton", "the CPU tritonserver (trtpipe serve)")
    src = Path(pytriton.__file__).parent / "tritonserver"
    if not (src / "bin" / "tritonserver").exists():
        raise ServingError(f"{src}: no bin/tritonserver in the nvidia-pytriton wheel")
    return src


def server_root() -> Path:
    """Where :func:`prepare_server` keeps the tritonserver copy for this nvidia-pytriton and Python."""
    pytriton = require("pytriton", "the CPU tritonserver (trtpipe serve)")

    version = getattr(pytriton, "__version__", "unknown")
    return cache_dir() / f"tritonserver-pytriton{version}-py{sys.version_info.major}.{sys.version_info.minor}"


def prepare_server() -> Path:
    """Copy the wheel's tritonserver into the cache (once, atomically); return that directory."""
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = server_root()
    if (root / "bin" / "tritonserver").exists():
        return root
    src = _pytriton_server_dir()
    stub = src / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.exists():
        raise ServingError(f"{stub.parent}: no python-backend stub for Python {py} in nvidia-pytriton")
    tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, symlinks=True)
    shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
    try:
        tmp.rename(root)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def server_env(base: Optional[dict] = None) -> dict:
    """The environment the CPU tritonserver and its python stubs need (see the module docstring)."""
    pytriton = require("pytriton", "the CPU tritonserver (trtpipe serve)")

    env = dict(os.environ if base is None else base)
    libs = [str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"), sysconfig.get_config_var("LIBDIR")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env[stub_watchdog.PYTHON_ENV] = sys.executable  # the stubs' watchdogs run on this interpreter
    return env


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


def server_command(
    binary: Path, backends: Path, repo: Path, bind: str, ports: Ports, shm_prefix: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """One tritonserver command line (CPU server, loopback by default)."""
    return [
        str(binary),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        *endpoint_flags(bind, ports),
        "--disable-auto-complete-config",
        "--exit-on-error=true",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        "--strict-readiness=true",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        *extra,
    ]


def endpoint_flags(bind: str, ports: Ports) -> list[str]:
    """The address and port flags of the one tritonserver that serves clients."""
    return [f"--{kind}-address={bind}" for kind in ("http", "grpc", "metrics")] + [
        f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}"]


def exposure_warning(bind: str) -> Optional[str]:
    """A one-line warning when the endpoints are reachable from other hosts (tritonserver has no authentication)."""
    if bind == "localhost":
        return None
    try:
        if ipaddress.ip_address(bind).is_loopback:
            return None
    except ValueError:
        pass
    return (f"warning: serving on {bind}: the HTTP, gRPC and metrics endpoints accept requests from other hosts, "
            "without authentication (default and recommended: 127.0.0.1 behind your own proxy)")


# The readiness endpoint of each kind of server ``trtpipe serve`` starts: tritonserver, or the OpenAI twin of
# trtllm-serve (``trtpipe.serving.openai_launch``, a ``target: llmapi`` recipe).
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
    # the Popen when this process started it (None when found through a state file): its exit status names the cause
    process: Optional[subprocess.Popen] = field(default=None, repr=False, compare=False)
    run_dir: Optional[Path] = field(default=None, compare=False)  # a leader-mode job's run dir (mpi_launch)

    @property
    def http_url(self) -> str:
        return f"http://{self.bind}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.bind}:{self.ports.grpc}"

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return pid_alive(self.pid)

    def ready(self) -> bool:
        if self.kind == "dynamo":  # Dynamo's frontend answers /health before any worker exists: a listed model is
            return bool(listed_models(self.http_url))  # what says it can serve
        return http_ready(self.http_url, READY_PATHS[self.kind])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait, SIGKILL if it hangs; then clean our shm regions and the state file."""
        if self.alive():
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
            d = {k: getattr(self, k) for k in ("pid", "repo", "bind", "log", "shm_prefix", "state_file", "kind")}
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


def start_server(
    repo: Path,
    bind: str = "127.0.0.1",
    ports: Optional[Ports] = None,
    log: Optional[Path] = None,
    timeout: float = READY_TIMEOUT_S,
    detach: bool = False,
    attempts: int = 3,
) -> Server:
    """Start tritonserver on ``repo`` and wait until it is ready; raise with the cause and log tail on failure.

    Args:
        repo: a model repository (``trtpipe.triton.repo.write_repo``'s output).
        bind: address for all three endpoints (loopback unless told otherwise).
        ports: fixed ports; default free ones, re-picked when the server reports one in use.
        log: server log file (default ``<cache>/logs/<repo name>-<hash>.tritonserver.log``).
        timeout: seconds to wait for ``/v2/health/ready``.
        detach: record a state file so ``trtpipe stop`` can find the server later.
    """
    repo = Path(repo).resolve()
    if not repo.is_dir():
        raise ServingError(f"{repo}: model repository not found")
    root = prepare_server()
    state = refuse_if_served(repo)
    log = Path(log) if log else cache_dir() / "logs" / f"{repo.name}-{state.stem}.tritonserver.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for attempt in range(attempts):
        use = ports or Ports(*free_ports(3, bind if bind != "0.0.0.0" else "127.0.0.1"))
        prefix = f"trtpipe{os.getpid()}_{use.grpc}_"
        cmd = server_command(root / "bin" / "tritonserver", root / "backends", repo, bind, use, prefix)
        log.write_text(f"# {shlex.join(cmd)}\n")
        proc = spawn(cmd, log, env=server_env(), cwd=log.parent)
        server = Server(proc.pid, str(repo), bind, use, str(log), prefix, process=proc)
        deadline = time.monotonic() + timeout
        try:
            up = _wait_ready(server, deadline)
        except BaseException:  # Ctrl-C / SIGTERM during start-up: do not leave the server behind
            server.stop()
            raise
        if up:
            if detach:
                server.detach(state)
            return server
        tail = log_tail(log)
        if proc.poll() is None:  # timed out while alive
            server.stop()
            raise ServingError(f"tritonserver on {repo} not ready after {timeout:.0f} s ({_cause(log)}); "
                               f"log {log}:\n{tail}")
        clean_shm(prefix)
        last_error = tail
        if "already in use" in tail and ports is None:
            continue
        break
    raise ServingError(f"tritonserver on {repo} exited during start-up: {_cause(log)}; log {log}:\n{last_error}")


NOISE = ("CudaDriverHelper", "NVML", "DCGM", "pinned memory", "CUDA stream", "cuda stream")


def _cause(log: Path) -> str:
    """The first real error of a tritonserver log (CPU start-up noise skipped), its python traceback cut off."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [ln for ln in lines if ln[:1] == "E" and ln[1:5].isdigit() and not any(n in ln for n in NOISE)]
    if not errors:
        rest = [ln for ln in lines if ln.strip() and not any(n in ln for n in NOISE)]
        return rest[-1].strip() if rest else "no error in the log"
    named = [ln for ln in errors if "failed to load '" in ln]  # names the model
    msg = (named or errors)[0].split("] ", 1)[-1].strip().strip('"')
    return msg.split("\\n", 1)[0].strip()


def _wait_ready(server: Server, deadline: float) -> bool:
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
            if s is not None:
                clean_shm(s.shm_prefix)
            continue
        found.append(s)
    return found




def serve_forever(server: Server) -> int:
    """Block until the server exits or we get Ctrl-C (or SIGTERM, see
    :func:`trtpipe.processes.sigterm_as_interrupt`); then stop it cleanly. Returns 0 after an interrupt; raises
    with the log tail when the server died on its own."""
    try:
        while server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        was_alive = server.alive()
        server.stop()
    if not was_alive:
        raise ServingError(f"{exit_cause(server)}; log {server.log}:\n{log_tail(Path(server.log))}")
    return 0


def exit_cause(server: Server) -> str:
    """'tritonserver (pid N) was killed by SIGKILL' / 'exited with status 3' / 'exited' (status unknown)."""
    code = server.process.poll() if server.process is not None else None
    what = f"tritonserver (pid {server.pid})"
    if code is None:
        return f"{what} exited"
    if code < 0:
        try:
            return f"{what} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{what} was killed by signal {-code}"
    return f"{what} exited with status {code}"
