"""The CPU twin's orchestrator mode: each ``tensorrt_llm`` model instance (the target, or the two-model form's
``tensorrt_llm_draft``) of one tritonserver starts and drives its own MPI world of rank workers, as upstream's
orchestrator spawns each model instance's executor workers (``TRTLLM_ORCHESTRATOR=1``: tensorrtllm_backend
``inflight_batcher_llm/src/model_instance_state.cc@dbae4e88``, ``getParallelConfigFromParams``; the launch is
:mod:`trtpipe.triton.orchestrator`).

The world is ``mpiexec -n WORLD``: rank 0 runs :func:`leader` (this module), which loads its shard with the others
(:func:`~trtpipe.serving.mpi_engine.start_leader`) and serves its :class:`~trtpipe.serving.mpi_engine.MpiStepEngine`
on a Unix socket in the world's run dir (:class:`~trtpipe.serving.draft_proxy.DraftServer`); ranks > 0 are
:mod:`trtpipe.serving.mpi_worker`. The stub's in-flight executor runs over
:class:`~trtpipe.serving.draft_proxy.DraftClient` (scheduling and sampling stay in the stub, the forward runs on the
ranks), the same machinery the two-model form's draft uses in leader mode. On the stub's ``finalize`` the world is told
to stop (a ``stop`` file), rank 0 releases the workers, and whatever is still running after a grace time is killed
with its process group, so no rank outlives the server. ``TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=0``
(``--disable-spawn-processes``, ranks placed by ``participant_ids``) is refused in one line, as upstream's python
backend refuses it (tensorrtllm_backend ``all_models/inflight_batcher_llm/tensorrt_llm/1/model.py@dbae4e88``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ORCHESTRATOR_ENV = "TRTLLM_ORCHESTRATOR"  # upstream's switch (launch_triton_server.py --multi-model sets it)
SPAWN_ENV = "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"  # 0: --disable-spawn-processes (participant_ids place the ranks)
PYTHON_ENV = "TRTPIPE_PYTHON"  # the venv interpreter trtpipe serve puts in the server's env (stub_watchdog)
STOP = "stop"
STOP_GRACE_S = 15.0


def enabled() -> bool:
    return os.environ.get(ORCHESTRATOR_ENV, "0") == "1"


def world_of(engine_dir: str | Path) -> int:
    """tp x pp of a CPU twin engine dir (its checkpoint's ``mapping.world_size``)."""
    from trtpipe.jsonfile import load_json

    cfg = load_json(Path(engine_dir) / "checkpoint" / "config.json")
    mapping = cfg.get("mapping") or {}
    return int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))


def _python() -> str:
    for candidate in (os.environ.get(PYTHON_ENV), sys.executable):
        if candidate and Path(candidate).name.startswith("python") and (Path(candidate).parent / "mpiexec").exists():
            return candidate
    raise RuntimeError(f"{ORCHESTRATOR_ENV}=1: no Python with an mpiexec beside it ({PYTHON_ENV} unset; trtpipe[mpi])")


class World:
    """One model instance's MPI world, started from the stub, and the step engine that drives it."""

    def __init__(self, engine_dir: str | Path, name: str, timeout: float = 600.0):
        from trtpipe.processes import cache_dir, spawn
        from trtpipe.serving.draft_proxy import DraftClient
        from trtpipe.triton.mpi_launch import mpmd

        if os.environ.get(SPAWN_ENV, "1") != "1":
            raise RuntimeError(
                f"{SPAWN_ENV}={os.environ[SPAWN_ENV]} (--disable-spawn-processes, participant_ids): the CPU twin runs "
                "orchestrator mode only with spawned workers; launch without --disable-spawn-processes"
            )
        self.world = world_of(engine_dir)
        runs = cache_dir() / "runs"
        runs.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"orchestrator-{name}-", dir=runs))
        python = _python()
        leader = [
            python,
            "-m",
            "mpi4py",
            "-m",
            "trtpipe.serving.orchestrator_world",
            str(engine_dir),
            str(self.run_dir),
        ]
        worker = [python, "-m", "mpi4py", "-m", "trtpipe.serving.mpi_worker", str(engine_dir)]
        cmd = mpmd([str(Path(python).parent / "mpiexec")], [leader] + [worker] * (self.world - 1))
        env = dict(os.environ)
        env.pop(ORCHESTRATOR_ENV, None)
        # the ranks run in the stub's working directory, so they import the trtpipe the stub imported
        self.proc = spawn(cmd, self.run_dir / "world.log", env=env, cwd=Path.cwd(), header=True, die_with_parent=True)
        try:
            self.client = _connect(self.run_dir, self.proc, timeout, DraftClient)
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        from trtpipe.triton.mpi_launch import descendants

        return [self.proc.pid, *descendants(self.proc.pid)]

    def close(self, grace: float = STOP_GRACE_S) -> None:
        """Stop the world: rank 0 releases the workers and every rank exits; the group is killed after ``grace``."""
        (self.run_dir / STOP).touch()
        try:
            self.proc.wait(timeout=grace)
        except Exception:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=3)
                    break
                except Exception:
                    continue
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.conn.close()
            except OSError:
                pass
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _connect(run_dir: Path, proc, timeout: float, client_type):
    """The client once rank 0 serves, or a one-line error with the world's log tail if the world ended first."""
    from trtpipe.serving.draft_proxy import KEY

    deadline = time.monotonic() + timeout
    while not (run_dir / KEY).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = (run_dir / "world.log").read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{ORCHESTRATOR_ENV}=1: the model's MPI world did not start ({run_dir}): {tail}")
        time.sleep(0.1)
    return client_type(run_dir, timeout=timeout)


def leader(engine_dir: str, run_dir: str) -> int:
    """Rank 0 of a world: load, serve the step engine to the stub, stop when told (or when the stub is gone)."""
    import torch

    from trtpipe.serving.draft_proxy import DraftServer
    from trtpipe.serving.mpi_engine import start_leader

    torch.set_num_threads(int(os.environ.get("TRTPIPE_CPU_THREADS", "1")))
    engine = start_leader(engine_dir, run_dir)
    DraftServer(engine, run_dir)
    stop = Path(run_dir) / STOP
    parent = os.getppid()
    while not stop.exists() and os.getppid() == parent:
        time.sleep(0.1)
    engine.shutdown()
    print("trtpipe orchestrator world: rank 0 stopped", flush=True)
    sys.stdout.flush()
    os._exit(0)  # as the workers do: no MPI_Finalize wait once the world is released


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m mpi4py -m trtpipe.serving.orchestrator_world ENGINE_DIR RUN_DIR", file=sys.stderr)
        return 2
    return leader(*argv)


if __name__ == "__main__":
    sys.exit(main())
