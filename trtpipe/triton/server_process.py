"""Start, watch and stop a real ``tritonserver``; find it again through its state file (``trtpipe stop``).

Policy (docs/reference/cpu-environment.md): the CPU server is the tritonserver 2.51 shipped inside nvidia-pytriton,
copied once into a cache directory of our own (never named ``triton``: that would shadow OpenAI Triton in
the models' imports), with the python-backend stub of this interpreter's version beside the backend. The
stub runs Python isolated, so it finds this venv's packages through ``PATH`` (venv ``bin`` first), and it
needs this interpreter's ``LIBDIR`` on ``LD_LIBRARY_PATH``. Port 0 does not work in tritonserver, so we pick
free ports and retry when one is taken in between. Every launch gets its own python-backend shared-memory
prefix so that cleaning ``/dev/shm`` after a stop only touches our own regions. The leader-mode launch
(:mod:`trtpipe.triton.mpi_launch`) builds on this module (its rank 0 is this server); the supervisor both use
(spawn, readiness, state file, teardown) is :mod:`trtpipe.supervisor`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional

from trtpipe.errors import ServingError
from trtpipe.extras import require
from trtpipe.processes import cache_dir, clean_shm, log_tail
from trtpipe.supervisor import READY_TIMEOUT_S, Ports, Server, free_ports, refuse_if_served, start, wait_ready
from trtpipe.triton import stub_watchdog

EXIT_TIMEOUT_S = 5  # how long tritonserver waits for open connections / in-flight requests on SIGTERM
# The admin APIs no trtpipe client uses, open to anyone who reaches the port otherwise: shared memory (a client
# could register the python backend's own /dev/shm regions, read them back and overwrite their headers: a stub
# dies, tritonserver aborts), logging and trace. tritonserver 2.51 refuses them (HTTP 403, gRPC UNAVAILABLE)
# unless a request carries ADMIN_HEADER with the launch's key: ``--http-restricted-api`` /
# ``--grpc-restricted-protocol`` ``<api>,...:<key>=<value>`` (``tritonserver --help``; Triton's
# docs/customization_guide/inference_protocols.md, "Limit Endpoint Access"). Inference, health, metadata, model
# config, statistics and the repository index stay open (trtpipe's client lists the models; perf_analyzer reads
# config and statistics); model load/unload is refused anyway (model control mode "none"). The key is on the
# command line (tritonserver reads it nowhere else): it keeps out the network, not this host's users.
RESTRICTED_APIS = ("shared-memory", "logging", "trace")
ADMIN_HEADER = "trtpipe-admin-key"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # tritonserver expects a gRPC client's restricted header so prefixed


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


def restricted_api_flags(admin_key: str) -> list[str]:
    """The flags that put :data:`RESTRICTED_APIS` behind the header ``ADMIN_HEADER: admin_key`` (HTTP and gRPC)."""
    env_ref = re.fullmatch(r"\$\([A-Z_][A-Z0-9_]*\)", admin_key or "")  # $(VAR): Kubernetes puts a Secret's key in
    if not env_ref and (not admin_key or not all(c.isalnum() or c in "-_" for c in admin_key)):
        raise ValueError(f"admin key {admin_key!r}: use letters, digits, '-' and '_' only (it is a header value)")
    apis = ",".join(RESTRICTED_APIS)
    return [
        f"--http-restricted-api={apis}:{ADMIN_HEADER}={admin_key}",
        f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={admin_key}",
    ]


def admin_headers(admin_key: str) -> dict:
    """The headers that open the restricted APIs to a client, HTTP or gRPC (each ignores the other's)."""
    return {ADMIN_HEADER: admin_key, GRPC_HEADER_PREFIX + ADMIN_HEADER: admin_key}


def new_admin_key() -> str:
    """A fresh key for one launch (nothing of trtpipe needs the restricted APIs; a test or an operator may)."""
    return secrets.token_hex(16)


def server_command(
    binary: Path,
    backends: Path,
    repo: Path,
    bind: str,
    ports: Ports,
    shm_prefix: str,
    extra: tuple[str, ...] = (),
    admin_key: Optional[str] = None,
) -> list[str]:
    """One tritonserver command line (CPU server, loopback by default); its admin APIs restricted to
    ``admin_key`` (a fresh one when not given)."""
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
        *restricted_api_flags(admin_key or new_admin_key()),
        *extra,
    ]


def endpoint_flags(bind: str, ports: Ports) -> list[str]:
    """The address and port flags of the one tritonserver that serves clients."""
    return [f"--{kind}-address={bind}" for kind in ("http", "grpc", "metrics")] + [
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
    ]


def exposure_warning(bind: str) -> Optional[str]:
    """A one-line warning when the endpoints are reachable from other hosts (tritonserver has no authentication)."""
    if bind == "localhost":
        return None
    try:
        if ipaddress.ip_address(bind).is_loopback:
            return None
    except ValueError:
        pass
    return (
        f"warning: serving on {bind}: the HTTP, gRPC and metrics endpoints accept requests from other hosts, "
        "without authentication (default and recommended: 127.0.0.1 behind your own proxy)"
    )


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
        key = new_admin_key()
        cmd = server_command(root / "bin" / "tritonserver", root / "backends", repo, bind, use, prefix, admin_key=key)
        log.write_text(f"# {shlex.join(cmd).replace(key, '<admin key>')}\n")
        server = start(cmd, log, repo, bind, use, "tritonserver", prefix, env=server_env(), cwd=log.parent)
        deadline = time.monotonic() + timeout
        try:
            up = wait_ready(server, deadline)
        except BaseException:  # Ctrl-C / SIGTERM during start-up: do not leave the server behind
            server.stop()
            raise
        if up:
            server.admin_headers = admin_headers(key)
            if detach:
                server.detach(state)
            return server
        tail = log_tail(log)
        if server.alive():  # timed out while alive
            server.stop()
            raise ServingError(
                f"tritonserver on {repo} not ready after {timeout:.0f} s ({_cause(log)}); log {log}:\n{tail}"
            )
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
