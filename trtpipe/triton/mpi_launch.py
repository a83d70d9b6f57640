"""Leader-mode serving of a tp x pp > 1 repository: one OS process per rank under one MPI launcher, supervised.

One launch, two payloads (leader mode, docs/reference/multi-gpu-launch.md): with TensorRT engines every rank is a
``tritonserver`` of the ``tensorrtllm`` backend (rank 0 serves the ports, the others load only the TensorRT-LLM model);
with the CPU twin, rank 0 is the ``tritonserver`` whose twin model holds rank 0's shard and runs the executor, and ranks
> 0 are ``trtpipe.serving.mpi_worker`` processes that serve nothing and run their shard of each broadcast step.

The supervisor (``python -m trtpipe.triton.mpi_launch RUN_DIR``, its own session) starts the launcher as its
child and becomes the child subreaper, so every process of the job stays its descendant even when MPI's
proxies die. It reports readiness once every rank loaded its shard (rank 0 writes ``ranks.json``) and the
server answers ``/v2/health/ready``; if any rank, the leader's model process or tritonserver dies it names it
(with its log tail) and tears the whole job down: SIGTERM to tritonserver (the twin releases the workers),
then SIGKILL to whatever is left, then the shared-memory files the job's processes had mapped are removed.

Run dir (``<cache>/runs/<name>``): ``launch.json`` (what to run), ``state.json`` (starting/ready/failed/
stopped), ``ranks.json``, ``rank{N}.log`` / ``rank{N}.pid`` (written by each rank's wrapper), ``mpiexec.log``.
The run dir must be on a file system every host sees for a multi-node twin launch.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.processes import (
    DRAFT_DIR_ENV,
    EXIT_RECORD_ENV,
    RUN_DIR_ENV,
    SHM_DIR,
    Child,
    cache_dir,
    clean_shm,
    log_tail,
    pid_alive,
    read_state,
    remove_files,
    spawn,
    write_state,
)
from trtpipe.supervisor import Ports, Server, http_ready, refuse_if_served
from trtpipe.triton.server_process import (
    endpoint_flags,
    new_admin_key,
    prepare_server,
    restricted_api_flags,
    server_command,
    server_env,
)

TEARDOWN_GRACE_S = 12.0  # tritonserver's exit timeout (5 s) + the twin's finalize + the workers' exit
FAILED_GRACE_S = 2.0  # after a rank died: SIGTERM to every process of the job, SIGKILL after this
POLL_S = 0.2
LAUNCHER_REPORT_S = 3.0  # how long to wait for a dead rank's wrapper record, or for mpiexec's report


# --- commands ----------------------------------------------------------------------------------------


def rank_wrapper(argv: Sequence[str], run_dir: Path, rank: int) -> list[str]:
    """``sh -c`` that runs the rank as its child and records how it ended, in the order things happen.

    The rank's pid goes to ``rank{N}.pid``, its output to ``rank{N}.log``, and when it ends its wait status (128 +
    the signal for a kill) to ``rank{N}.status``, written before the wrapper itself exits. The launcher sees a rank
    end only when its wrapper exits, after that record, so the rank that was killed or crashed is the one whose
    record says so: evidence that does not depend on how fast anyone polls. A rank that ends by itself (a worker
    whose leader is gone) also says why in ``rank{N}.exit`` (:func:`trtpipe.processes.record_exit`). MPICH's
    notice to the survivors (SIGUSR1, with its clean-up off) is ignored, so they live until the supervisor acts.
    """
    # The rank runs in the foreground (a background job would start with SIGINT ignored) of an inner sh that writes
    # its own pid and execs it, so rank{N}.pid is the rank's pid.
    script = (
        f'trap "" USR1; export {EXIT_RECORD_ENV}="$0/rank{rank}.exit"; '
        f'sh -c \'echo $$ > "$0"; exec "$@"\' "$0/rank{rank}.pid" "$@" >> "$0/rank{rank}.log" 2>&1; '
        f'code=$?; echo $code > "$0/rank{rank}.status"; exit $code'
    )
    return ["sh", "-c", script, str(run_dir), *map(str, argv)]


def mpmd(launcher: Sequence[str], segments: Sequence[Sequence[str]]) -> list[str]:
    """``LAUNCHER -n 1 rank0... : -n 1 rank1... : ...`` (MPMD: rank i runs segment i)."""
    cmd = list(launcher)
    for i, seg in enumerate(segments):
        if i:
            cmd.append(":")
        cmd += ["-n", "1", *map(str, seg)]
    return cmd


def mpirun_command(
    repo: Path,
    world_size: int,
    ports: Ports,
    bind: str = "127.0.0.1",
    tritonserver: str = "/opt/tritonserver/bin/tritonserver",
    trtllm_models: tuple[str, ...] = ("tensorrt_llm",),
    log_file: Optional[str] = None,
    hostfile: Optional[Path] = None,
    admin_key: Optional[str] = None,
) -> list[str]:
    """The leader-mode MPMD launch of upstream's launch_triton_server.py (docs/reference/multi-gpu-launch.md): one
    tritonserver per rank under one ``mpirun``.

    Rank 0 serves the ports, its admin APIs restricted to ``admin_key`` (a fresh one when not given; see
    :data:`trtpipe.triton.server_process.RESTRICTED_APIS`); ranks > 0 load only the TensorRT-LLM model(s)
    explicitly and open no endpoint.
    Each rank gets its own python-backend shm prefix so their regions do not collide.
    """
    segments = []
    for rank in range(world_size):
        seg = [tritonserver, f"--model-repository={repo}"]
        if rank == 0:
            seg += endpoint_flags(bind, ports) + restricted_api_flags(admin_key or new_admin_key())
            if log_file:
                seg += ["--log-verbose=3", f"--log-file={log_file}"]
        else:
            seg += [
                "--allow-http=false",
                "--allow-grpc=false",
                "--allow-metrics=false",
                "--model-control-mode=explicit",
            ]
            seg += [f"--load-model={name}" for name in trtllm_models]
        seg += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]
        segments.append(seg)
    launcher = ["mpirun", "--allow-run-as-root"] + (["--hostfile", str(hostfile)] if hostfile else [])
    return mpmd(launcher, segments)


def venv_mpiexec() -> str:
    """The MPICH mpiexec of this interpreter's environment (it must be the MPI that mpi4py loads)."""
    path = Path(sys.executable).parent / "mpiexec"
    if not path.exists():
        raise ServingError(f"{path}: no mpiexec beside this Python (pip install 'trtpipe[mpi]' installs MPICH)")
    return str(path)


def twin_segments(
    repo: Path, engine_dir: Path, world: int, bind: str, ports, shm_prefix: str, draft_dir: Optional[Path] = None
) -> list[list[str]]:
    """Rank 0: the CPU tritonserver (the twin model is the leader); ranks > 0: MPI workers that serve nothing (with
    ``draft_dir``, the two-model form's draft engine, they also hold its shards: trtpipe.serving.draft_proxy)."""
    root = prepare_server()
    rank0 = server_command(root / "bin" / "tritonserver", root / "backends", repo, bind, ports, shm_prefix)
    worker = [sys.executable, "-m", "mpi4py", "-m", "trtpipe.serving.mpi_worker", str(engine_dir)]
    worker += ["--draft", str(draft_dir)] if draft_dir is not None else []
    return [rank0] + [worker] * (world - 1)


def launcher_argv(mpiexec: str, hostfile: Optional[Path] = None) -> list[str]:
    """MPICH's launcher with its clean-up on error turned off: when a rank dies, hydra would SIGKILL the others at
    once, and which of several dead ranks went first would then be a race. Left alone, the others keep running (or
    end by themselves, writing an exit record) until the supervisor names the dead one and tears the job down."""
    return [mpiexec, "-disable-auto-cleanup"] + (["-f", str(hostfile)] if hostfile else [])


def run_foreground(command: Sequence[str]) -> int:
    """Leader mode with TensorRT engines (the TensorRT-LLM container's OpenMPI ``mpirun``), in the foreground:
    its exit code; Ctrl-C reaches it through our process group, and an exception here kills it."""
    if shutil.which("mpirun") is None:
        raise ServingError("mpirun is not on PATH (the TensorRT-LLM container ships OpenMPI)")
    child = spawn(command, None, session=False)
    try:
        return child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise


def slurm_lines(segments: Sequence[Sequence[str]], conf: str = "trtpipe_ranks.conf") -> list[str]:
    """The same job for a Slurm allocation: ``srun --mpi=pmi2 --multi-prog`` with one line per rank."""
    lines = [f"# Slurm: write {conf} as below, then run: srun --mpi=pmi2 -n {len(segments)} --multi-prog {conf}"]
    lines += [f"#   {rank} {shlex.join(list(map(str, seg)))}" for rank, seg in enumerate(segments)]
    return lines


# --- process helpers ---------------------------------------------------------------------------------


def _proc_table() -> dict[int, int]:
    """pid -> ppid of every process (Linux /proc)."""
    table = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            table[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return table


def descendants(pid: int) -> list[int]:
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, pp in table.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _set_subreaper() -> None:
    """Orphans of the job (ranks whose MPI proxy died) are re-parented to us, so we can find and reap them."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# --- the supervisor ----------------------------------------------------------------------------------


class Supervisor:
    """Runs in its own process: start the job, report readiness, watch every rank, tear down."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.launch = read_state(self.run_dir / "launch.json")
        if not self.launch:
            raise ServingError(f"{self.run_dir}/launch.json: missing or invalid")
        self.world = int(self.launch["world_size"])
        self.proc: Optional[Child] = None
        self.stop_reason: Optional[str] = None
        self.shm_seen: set[str] = set()
        self.rank_pids: dict[int, int] = {}
        self.first_dead: Optional[int] = None  # the one pid seen dead alone by the fast watcher (who went first)
        self._watching = False

    def state(self, state: str, **extra) -> None:
        write_state(self.run_dir / "state.json", {"state": state, "supervisor_pid": os.getpid(), **extra})

    def _on_signal(self, signum, frame) -> None:
        self.stop_reason = f"stopped by {signal.Signals(signum).name}"

    def run(self) -> int:
        _set_subreaper()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.state("starting")
        env = dict(os.environ)
        env.update(self.launch.get("env", {}))
        # the launcher SIGTERMed if the supervisor dies (even by SIGKILL): it then ends the ranks itself, so a lost
        # supervisor does not leave a headless job
        self.proc = spawn(
            self.launch["command"],
            self.run_dir / "mpiexec.log",
            env=env,
            cwd=self.run_dir,
            session=False,
            die_with_parent=True,
        )
        deadline = time.monotonic() + float(self.launch.get("timeout", 180))
        ready, t_start = False, time.monotonic()
        while True:
            time.sleep(POLL_S)
            _reap()
            if self.stop_reason:
                return self.teardown(0, self.stop_reason)
            self._note_pids_and_shm()
            if not self._watching and len(self.rank_pids) == self.world:
                self._watching = True
                threading.Thread(target=self._watch_deaths, daemon=True).start()
            failure = self.failure()
            if failure:
                return self.teardown(1, failure)
            if not ready:
                ranks = read_state(self.run_dir / "ranks.json")
                if ranks and all(r["ok"] for r in ranks) and self._http_ready():
                    ready = True
                    self.state("ready", ranks=ranks, startup_s=round(time.monotonic() - t_start, 2), pids=self._pids())
                elif time.monotonic() > deadline:
                    return self.teardown(
                        1,
                        f"not ready after {self.launch.get('timeout')} s "
                        f"({self._loaded()} of {self.world} ranks loaded); " + self._tail_of(0),
                    )

    # -- watching --
    def _watch_deaths(self) -> None:
        """Every 10 ms: when a process of the job dies, the launcher kills the others within moments; seeing
        one dead alone names who went first, more surely than the launcher's report on a loaded machine."""
        while self.first_dead is None:
            pids = [p for p in [self._leader_pid(), *self.rank_pids.values()] if p]
            dead = [p for p in pids if not pid_alive(p)]
            if len(dead) == 1:
                self.first_dead = dead[0]
            if dead:
                return
            time.sleep(0.01)

    def _http_ready(self) -> bool:
        return http_ready(self.launch["http_url"])

    def _note_pids_and_shm(self) -> None:
        for r in range(self.world):
            if r not in self.rank_pids:
                try:
                    self.rank_pids[r] = int((self.run_dir / f"rank{r}.pid").read_text().strip())
                except (OSError, ValueError):
                    pass
        for pid in [p for p in self._pids().values() if p]:
            try:
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    path = line.split()[-1] if len(line.split()) >= 6 else ""
                    if path.startswith("/dev/shm/"):
                        self.shm_seen.add(path)
            except OSError:
                pass

    def _leader_pid(self) -> Optional[int]:
        ranks = read_state(self.run_dir / "ranks.json") or []
        return next((r["pid"] for r in ranks if r.get("rank") == 0), None)

    def _pids(self) -> dict[str, Optional[int]]:
        pids = {f"rank{r}": p for r, p in self.rank_pids.items()}
        pids["leader"] = self._leader_pid()
        pids["launcher"] = self.proc.pid if self.proc else None
        return pids

    def _loaded(self) -> int:
        return sum(1 for r in (read_state(self.run_dir / "ranks.json") or []) if r.get("ok"))

    def _what(self, rank: int) -> str:
        if rank == 0:
            return "tritonserver" if self.launch.get("twin") else "tritonserver (leader)"
        return "worker" if self.launch.get("twin") else "tritonserver"

    def _tail_of(self, rank: int, lines: int = 15) -> str:
        path = self.run_dir / f"rank{rank}.log"
        return f"log {path}:\n{log_tail(path, lines)}"

    def failure(self) -> Optional[str]:
        """What went wrong, naming the rank (None while everything runs)."""
        ranks = read_state(self.run_dir / "ranks.json")
        if ranks and not all(r["ok"] for r in ranks):
            bad = [r for r in ranks if not r["ok"]]
            return (
                "; ".join(f"rank {r['rank']} ({r['host']}) failed to load its shard: {r['error']}" for r in bad)
                + "\n"
                + self._tail_of(bad[0]["rank"])
            )
        dead = []
        leader = self._leader_pid()
        if leader and not pid_alive(leader):
            dead.append((0, leader, "the leader (tensorrt_llm model process)"))
        for r, pid in sorted(self.rank_pids.items()):
            if not pid_alive(pid):
                dead.append((r, pid, self._what(r)))
        launcher_done = self.proc is not None and self.proc.poll() is not None
        if not dead and not launcher_done:
            return None
        self._await_records(dead)
        killed = self._killed_ranks(dead)
        if len(killed) == 1:  # its wrapper saw it die of a signal, and it did not end by itself
            (r, pid, what), how = killed[0]
            return f"rank {r} ({what}, pid {pid}) died: {how}\n" + self._tail_of(r)
        if not launcher_done:  # no record names one rank: the launcher's own report comes when it exits
            try:
                self.proc.wait(LAUNCHER_REPORT_S)
            except subprocess.TimeoutExpired:
                pass
        unexplained = [d for d in dead if not (self.run_dir / f"rank{d[0]}.exit").exists()]
        if len(unexplained) == 1:  # the others said they ended because of it
            r, pid, what = unexplained[0]
            return f"rank {r} ({what}, pid {pid}) died (the ranks that ended after it said why)\n" + self._tail_of(r)
        for r, pid, what in dead:
            if pid == self.first_dead:
                first = self._first_bad_termination()
                how = (
                    first[1] if first is not None and first[0] == pid else "it was the first process of the job to exit"
                )
                return f"rank {r} ({what}, pid {pid}) died: {how}\n" + self._tail_of(r)
        first = self._first_bad_termination()
        if first is not None:  # the launcher saw which process went first (the others are its clean-up)
            for r, pid, what in dead:
                if pid == first[0]:
                    return f"rank {r} ({what}, pid {pid}) died: {first[1]}\n" + self._tail_of(r)
        if dead:
            r, pid, what = dead[0]
            return f"rank {r} ({what}, pid {pid}) exited\n" + self._tail_of(r)
        return f"the MPI launcher exited with code {self.proc.returncode}\n" + self._tail_of(0)

    def _await_records(self, dead: list[tuple[int, int, str]]) -> None:
        """A dead rank's wrapper writes its status just after the rank ends: wait for those records (bounded; a
        wrapper that was killed too never writes one)."""
        deadline = time.monotonic() + LAUNCHER_REPORT_S
        pending = [r for r, pid, _ in dead if pid == self.rank_pids.get(r)]
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if not (self.run_dir / f"rank{r}.status").exists()]
            if pending:
                time.sleep(0.02)

    def _killed_ranks(self, dead: list[tuple[int, int, str]]) -> list[tuple[tuple[int, int, str], str]]:
        """The dead ranks whose wrapper recorded a death by signal (``rank{N}.status`` > 128) and that did not
        record ending by themselves (``rank{N}.exit``), with how they died."""
        out = []
        for entry in dead:
            r, pid, _ = entry
            if pid != self.rank_pids.get(r) or (self.run_dir / f"rank{r}.exit").exists():
                continue
            try:
                code = int((self.run_dir / f"rank{r}.status").read_text().strip())
            except (OSError, ValueError):
                continue
            if code > 128:
                try:
                    how = f"killed by {signal.Signals(code - 128).name}"
                except ValueError:
                    how = f"killed by signal {code - 128}"
                out.append((entry, how))
        return out

    def _first_bad_termination(self) -> Optional[tuple[int, str]]:
        try:
            text = (self.run_dir / "mpiexec.log").read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"PID (\d+) RUNNING AT .*?\n=\s+EXIT CODE: (\d+)", text)
        if not m:
            return None
        code = int(m.group(2))
        sig = re.search(r"EXIT STRING: (.+)", text)
        return int(m.group(1)), (sig.group(1).strip() if sig else f"exit code {code}")

    # -- tearing down --
    def teardown(self, code: int, reason: str) -> int:
        """A stop is graceful (SIGTERM to tritonserver: the twin's finalize releases the workers); after a failure
        the job is already broken, so everything gets SIGTERM at once. Whatever is left after the grace time
        gets SIGKILL; zombies re-parented to us are reaped."""
        self.state("stopping", error=reason if code else None)
        t0 = time.monotonic()
        grace = TEARDOWN_GRACE_S if code == 0 else FAILED_GRACE_S
        targets = [self.rank_pids.get(0)] if code == 0 else descendants(os.getpid())
        for pid in targets:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        while time.monotonic() - t0 < grace and self._live_descendants():
            _reap()
            time.sleep(POLL_S)
        left = self._live_descendants()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while descendants(os.getpid()) and time.monotonic() - t0 < grace + 10:
            _reap()
            time.sleep(0.05)
        _reap()
        removed = self._clean_shm()
        self.state(
            "failed" if code else "stopped",
            error=reason if code else None,
            exit_code=code,
            teardown_s=round(time.monotonic() - t0, 2),
            killed=left,
            shm_removed=removed,
        )
        return code

    def _live_descendants(self) -> list[int]:
        return [p for p in descendants(os.getpid()) if pid_alive(p)]

    def _clean_shm(self) -> list[str]:
        seen = [Path(path) for path in sorted(self.shm_seen)]
        return clean_shm(self.launch["shm_prefix"]) + remove_files(p for p in seen if p.parent == SHM_DIR)


# --- the serve side ----------------------------------------------------------------------------------


def run_dir_for(repo: Path) -> Path:
    d = cache_dir() / "runs" / f"{Path(repo).name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=False)
    return d


def launch_spec(
    repo: Path,
    info: dict,
    bind: str,
    ports,
    run_dir: Path,
    hostfile: Optional[Path] = None,
    timeout: float = 180.0,
    mpiexec: Optional[str] = None,
) -> dict:
    world = int(info["world_size"])
    shm_prefix = f"trtpipe{os.getpid()}_{ports.grpc}_"
    engine = Path(repo) / "tensorrt_llm" / "engine"  # the copy rank 0's twin loads (gpt_model_path)
    engine = engine if engine.is_dir() else Path(info["engine"])
    draft = Path(repo) / "tensorrt_llm_draft" / "engine"  # the two-model form's draft (every rank holds a shard)
    draft = draft.resolve() if draft.is_dir() else None
    segments = twin_segments(repo, engine, world, bind, ports, shm_prefix, draft)
    command = mpmd(
        launcher_argv(mpiexec or venv_mpiexec(), hostfile),
        [rank_wrapper(seg, run_dir, r) for r, seg in enumerate(segments)],
    )
    env = server_env({})
    env[RUN_DIR_ENV] = str(run_dir)
    if draft is not None:
        env[DRAFT_DIR_ENV] = str(draft)  # rank 0's target stub loads it (mpi_engine.start_leader)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return {
        "command": command,
        "env": env,
        "world_size": world,
        "twin": True,
        "repo": str(repo),
        "http_url": f"http://{bind if bind != '0.0.0.0' else '127.0.0.1'}:{ports.http}",
        "shm_prefix": shm_prefix,
        "timeout": timeout,
        "segments": segments,
    }


def start_job(
    repo: Path,
    info: dict,
    bind: str,
    ports,
    timeout: float,
    hostfile: Optional[Path] = None,
    detach: bool = False,
    echo=print,
):
    """Start the supervised job and wait until it is ready; raise :class:`ServingError` naming the failing rank.

    Returns a :class:`trtpipe.supervisor.Server` whose pid is the supervisor's (``stop`` ends the job).
    """
    repo = Path(repo).resolve()
    state_file = refuse_if_served(repo)
    run_dir = run_dir_for(repo)
    spec = launch_spec(repo, info, bind, ports, run_dir, hostfile, timeout)
    write_state(run_dir / "launch.json", spec)
    proc = spawn([sys.executable, "-m", "trtpipe.triton.mpi_launch", str(run_dir)], run_dir / "supervisor.log")
    server = Server(
        proc.pid, str(repo), bind, ports, str(run_dir / "rank0.log"), spec["shm_prefix"], process=proc, run_dir=run_dir
    )
    try:
        state = wait_state(run_dir, proc, ("ready", "failed", "stopped"))
    except BaseException:  # Ctrl-C during start-up: end the job
        server.stop()
        raise
    if state.get("state") != "ready":
        raise ServingError(f"leader-mode launch of {repo} failed: {state.get('error') or state}")
    if detach:
        server.detach(state_file)
    return server, state


def wait_state(run_dir: Path, proc: Child, want: Sequence[str]) -> dict:
    while True:
        state = read_state(run_dir / "state.json") or {}
        if state.get("state") in want:
            return state
        if proc.poll() is not None:
            state = read_state(run_dir / "state.json") or {}
            if state.get("state") in want:
                return state
            tail = (run_dir / "supervisor.log").read_text(errors="replace")[-2000:]
            return {"state": "failed", "error": f"the supervisor exited with code {proc.returncode}: {tail}"}
        time.sleep(POLL_S)


def serve_job_forever(server, run_dir: Path) -> int:
    """Foreground: wait for the job; Ctrl-C/SIGTERM end it cleanly (0); a died rank raises naming it."""
    try:
        while server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        server.stop()
        return 0
    state = read_state(Path(run_dir) / "state.json") or {}
    if state.get("state") == "stopped":
        return 0
    raise ServingError(f"leader-mode job failed: {state.get('error') or state}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trtpipe.triton.mpi_launch RUN_DIR", file=sys.stderr)
        return 2
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main())
