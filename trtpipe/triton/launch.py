"""What ``trtpipe serve`` runs: resolve a repository (or build it from a recipe) and plan the launch.

CPU twin repositories run on the tritonserver shipped in nvidia-pytriton (one process: the twin executes
every tp/pp rank's shards itself). TensorRT-engine repositories need the ``tensorrtllm`` backend and one
tritonserver per rank under ``mpirun`` (leader mode, contract §7.1); that command is always printable
with ``--dry-run``, and it is only run when the installed TensorRT-LLM is the one that built the engine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.triton.mpi_launch import mpirun_command
from trtpipe.triton.server_process import Ports, free_ports

REPO_INFO = "trtpipe_repo.json"


def repo_info(repo: Path) -> dict:
    path = Path(repo) / REPO_INFO
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ServingError(f"{repo}: not a trtpipe model repository (no {REPO_INFO}; write one with trtpipe repo)") from None
    except ValueError as exc:
        raise ServingError(f"{path}: invalid JSON ({exc})") from None


def resolve_repo(target: Path, overrides: Sequence[str] = (), quiet: bool = False) -> Path:
    """A repository directory as is; a recipe file is built up to the ``repo`` stage (cached stages reused)."""
    target = Path(target)
    if target.is_dir():
        repo_info(target)
        return target.resolve()
    if not target.is_file():
        raise ServingError(f"{target}: neither a model repository directory nor a recipe file")
    from trtpipe.pipeline.runner import run_build
    from trtpipe.validation import load_recipe

    recipe = load_recipe(target, overrides)
    result = run_build(recipe, until="repo", quiet=quiet, overrides=overrides)
    entry = result.stage("repo")
    if not entry.get("artifact") or not (result.artifact("repo") / REPO_INFO).exists():
        raise ServingError(f"{target}: the repo stage did not produce a repository (status {entry.get('status')})")
    return result.artifact("repo")


def installed_trtllm() -> Optional[str]:
    from trtpipe.engine.versions import package_version

    return package_version("tensorrt_llm", "tensorrt-llm")


def engine_lock(engine_dir: Path) -> dict:
    """The build environment the engine stage recorded (``trtpipe_lock.json``: TensorRT-LLM, TensorRT, ...)."""
    path = Path(engine_dir) / "trtpipe_lock.json"
    try:
        lock = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return lock.get("lockfile", lock)


def check_engine_versions(info: dict, installed: Optional[str], installed_trt: Optional[str] = None,
                          lock: Optional[dict] = None) -> None:
    """Refuse an engine built by another TensorRT-LLM (or TensorRT) release: plans do not deserialize across
    versions (contract §8). ``lock``: the engine's recorded build environment, when there is one."""
    built = info.get("engine_version")
    if installed is None:
        raise ServingError(
            f"the engine {info.get('engine')} needs TensorRT-LLM {built} and its Triton backend, which are not installed "
            "here; serve it in the matching tritonserver container (trtpipe serve --dry-run prints the command)"
        )
    if built != installed:
        raise ServingError(
            f"the engine {info.get('engine')} was built with TensorRT-LLM {built} but {installed} is installed; "
            "rebuild it (trtpipe build RECIPE --from engine) or serve it with TensorRT-LLM " + str(built)
        )
    want_trt = (lock or {}).get("tensorrt")
    if want_trt and installed_trt != want_trt:
        raise ServingError(
            f"the engine {info.get('engine')} was built with TensorRT {want_trt} but {installed_trt or 'no TensorRT'} "
            "is installed; rebuild it here (trtpipe build RECIPE --from engine)"
        )


@dataclass
class LaunchPlan:
    repo: Path
    twin: bool
    world_size: int
    command: Optional[list[str]]  # the mpirun command (TensorRT engines), None for the CPU twin


def plan_launch(repo: Path, bind: str = "127.0.0.1", ports: Optional[Ports] = None,
                tritonserver: str = "/opt/tritonserver/bin/tritonserver", hostfile: Optional[Path] = None) -> LaunchPlan:
    info = repo_info(repo)
    if info.get("twin"):
        return LaunchPlan(Path(repo), True, int(info.get("world_size", 1)), None)
    ports = ports or Ports(*free_ports(3))
    world = int(info.get("world_size", 1))
    cmd = mpirun_command(Path(repo).resolve(), world, ports, bind, tritonserver, hostfile=hostfile)
    return LaunchPlan(Path(repo), False, world, cmd)


def run_mpirun(plan: LaunchPlan) -> int:
    """Run the leader-mode launch in the foreground (TensorRT-LLM container); returns mpirun's exit code."""
    from trtpipe.engine.versions import package_version

    info = repo_info(plan.repo)
    check_engine_versions(info, installed_trtllm(), package_version("tensorrt", "tensorrt-cu12", "tensorrt_cu12"),
                          engine_lock(Path(info.get("engine", ""))))
    if shutil.which("mpirun") is None:
        raise ServingError("mpirun is not on PATH (the TensorRT-LLM container ships OpenMPI)")
    return subprocess.call(plan.command)


def find_detached(target: Optional[Path] = None, overrides: Sequence[str] = ()) -> list:
    """Detached servers of ``target``: a repository dir, or a recipe (servers of repos under its work dir)."""
    from trtpipe.triton.server_process import detached_servers

    servers = detached_servers()
    if target is None:
        return servers
    target = Path(target)
    if target.is_file():
        from trtpipe.validation import load_recipe

        work = str(load_recipe(target, overrides, check_rules=False).work_path) + "/"
        return [s for s in servers if s.repo.startswith(work)]
    want = str(target.resolve())
    return [s for s in servers if s.repo == want]


def one_detached(target: Optional[Path] = None, overrides: Sequence[str] = ()):
    servers = find_detached(target, overrides)
    if len(servers) != 1:
        where = f" for {target}" if target else ""
        listing = "; ".join(f"pid {s.pid} {s.repo}" for s in servers)
        raise ServingError(f"{len(servers)} detached servers run{where}" + (f" ({listing})" if listing else "")
                           + ": name one (--server REPO_OR_RECIPE) or pass --url")
    return servers[0]


def planned_launch(recipe_path: Path, overrides: Sequence[str], bind: str, ports: Optional[Ports],
                   tritonserver: str, hostfile: Optional[Path] = None) -> tuple[LaunchPlan, bool]:
    """The launch of a recipe without building it (``serve RECIPE --dry-run``): the repository path its repo
    stage has or will have, and the TensorRT leader-mode command for the recipe's world size.

    Returns the plan and whether the repository is already built (then it is read, not predicted).
    """
    from trtpipe.pipeline.cache import ArtifactStore
    from trtpipe.pipeline.runner import plan_build
    from trtpipe.validation import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    plans, _ = plan_build(recipe)
    repo_plan = next((p for p in plans if p.name == "repo"), None)
    if repo_plan is None or repo_plan.key is None:
        raise ServingError(f"{recipe_path}: the repo stage cannot be planned ({getattr(repo_plan, 'reason', 'absent')})")
    repo = ArtifactStore(recipe.work_path).path("repo", repo_plan.key)
    if repo_plan.cached and (repo / REPO_INFO).exists():
        return plan_launch(repo, bind, ports, tritonserver, hostfile), True
    world = recipe.parallel.world_size
    ports = ports or Ports(*free_ports(3))
    return LaunchPlan(repo, False, world, mpirun_command(repo, world, ports, bind, tritonserver, hostfile=hostfile)), False


def dry_run_lines(target: Path, overrides: Sequence[str], bind: str, ports: Optional[Ports],
                  tritonserver: str, hostfile: Optional[Path] = None) -> list[str]:
    """What ``serve --dry-run`` prints: comment lines, then the command (a recipe is planned, never built)."""
    import shlex

    from trtpipe.triton import server_process

    lines = []
    if Path(target).is_file():
        plan, built = planned_launch(Path(target), overrides, bind, ports, tritonserver, hostfile)
        if not built:
            from trtpipe.engine.trtllm import availability

            lines.append(f"# not built yet: trtpipe build {target} writes {plan.repo}")
            avail = availability()
            if not avail.ok:
                lines.append(f"# here the build writes the CPU twin ({avail.reason}); below is the TensorRT launch")
    else:
        plan = plan_launch(Path(target).resolve(), bind, ports, tritonserver, hostfile)
    if plan.command is None and plan.world_size > 1:
        return lines + _twin_leader_lines(plan, bind, ports, tritonserver, hostfile)
    if plan.command is None:
        root = server_process.server_root()
        cmd = server_process.server_command(root / "bin" / "tritonserver", root / "backends", plan.repo, bind,
                                 ports or Ports(0, 0, 0), "trtpipe_")
        lines.append("# CPU twin: one tritonserver (ports 0: free ones are chosen at start)")
    else:
        cmd = plan.command
        lines.append(f"# TensorRT engines, leader mode: world_size {plan.world_size}")
    if plan.world_size > 1:
        from trtpipe.triton.mpi_launch import slurm_lines

        lines += slurm_lines(_segments(cmd))
    return lines + [shlex.join(cmd)]


def _segments(cmd: list[str]) -> list[list[str]]:
    """The per-rank argv of an MPMD command (``... -n 1 ARGV : -n 1 ARGV``)."""
    first = cmd.index("-n")
    segs, cur = [], []
    for tok in cmd[first:] + [":"]:
        if tok == ":":
            segs.append(cur[2:])
            cur = []
        else:
            cur.append(tok)
    return segs


def _twin_leader_lines(plan: LaunchPlan, bind: str, ports: Optional[Ports], tritonserver: str,
                       hostfile: Optional[Path]) -> list[str]:
    """A CPU-twin tp/pp > 1 repository: the mpiexec job serve runs, then the same launch with TensorRT engines."""
    import shlex

    from trtpipe.triton import mpi_launch

    ports = ports or Ports(*free_ports(3))
    info = repo_info(plan.repo)
    run_dir = Path("<run dir>")
    spec = mpi_launch.launch_spec(plan.repo, info, bind, ports, run_dir, hostfile)
    trt = mpirun_command(plan.repo, plan.world_size, ports, bind, tritonserver, hostfile=hostfile)
    lines = [f"# with TensorRT engines (tensorrtllm backend) the same launch runs: world_size {plan.world_size}",
             "#   " + shlex.join(trt)]
    lines += mpi_launch.slurm_lines(spec["segments"])
    lines += [f"# CPU twin, leader mode: {plan.world_size} ranks under mpiexec (rank 0 tritonserver + twin executor, "
              f"ranks 1..{plan.world_size - 1} workers); serve runs it under a supervisor (run dir in the cache)",
              shlex.join(spec["command"])]
    return lines
