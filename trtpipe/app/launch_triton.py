"""What ``trtpipe serve`` runs: resolve a repository (or build it from a recipe) and plan the launch.

CPU twin repositories run on the tritonserver shipped in nvidia-pytriton (one process: the twin executes every tp/pp
rank's shards itself). TensorRT-engine repositories need the ``tensorrtllm`` backend and one tritonserver per rank under
``mpirun`` (leader mode, docs/reference/multi-gpu-launch.md); that command is always printable with ``--dry-run``, and
it is only run when the installed TensorRT-LLM is the one that built the engine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.processes import sigterm_as_interrupt
from trtpipe.triton.mpi_launch import mpirun_command
from trtpipe.supervisor import Ports, free_ports
from trtpipe.jsonfile import load_json

REPO_INFO = "trtpipe_repo.json"


def repo_info(repo: Path) -> dict:
    path = Path(repo) / REPO_INFO
    try:
        return load_json(path)
    except FileNotFoundError:
        raise ServingError(
            f"{repo}: not a trtpipe model repository (no {REPO_INFO}; write one with trtpipe repo)"
        ) from None
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
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(target, overrides)
    result = run_build(recipe, STAGES, until="repo", quiet=quiet, overrides=overrides)
    entry = result.stage("repo")
    if not entry.get("artifact") or not (result.artifact("repo") / REPO_INFO).exists():
        raise ServingError(f"{target}: the repo stage did not produce a repository (status {entry.get('status')})")
    return result.artifact("repo")


def installed_trtllm() -> Optional[str]:
    from trtpipe.pipeline.versions import PACKAGES, package_version

    return package_version(*PACKAGES["tensorrt_llm"])


def engine_lock(engine_dir: Path) -> dict:
    """The build environment the engine stage recorded (``trtpipe_lock.json``: TensorRT-LLM, TensorRT, ...)."""
    path = Path(engine_dir) / "trtpipe_lock.json"
    try:
        lock = load_json(path)
    except (OSError, ValueError):
        return {}
    return lock.get("lockfile", lock)


def check_engine_versions(
    info: dict, installed: Optional[str], installed_trt: Optional[str] = None, lock: Optional[dict] = None
) -> None:
    """Refuse an engine built by another TensorRT-LLM (or TensorRT) release: plans do not deserialize across versions
    (trtllm-build.md#version-compatibility). ``lock``: the engine's recorded build environment, when there is one."""
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
    mode: str = "leader"  # "orchestrator": the two-model form at tp x pp > 1 (trtpipe.triton.orchestrator)


def engine_launch(
    repo: Path,
    world: int,
    ports: Ports,
    bind: str,
    tritonserver: str,
    hostfile: Optional[Path] = None,
    ids: Optional[dict[str, str]] = None,
) -> tuple[list[str], str]:
    """The TensorRT-engine launch and its mode: leader mode, or (``ids``: each TensorRT-LLM model's gpu_device_ids,
    the two-model form at tp x pp > 1) upstream's orchestrator mode, one tritonserver on one node."""
    if ids is None:
        return mpirun_command(repo, world, ports, bind, tritonserver, hostfile=hostfile), "leader"
    from trtpipe.triton.orchestrator import gpus_needed, orchestrator_command
    from trtpipe.triton.server_process import endpoint_flags, new_admin_key, restricted_api_flags

    if hostfile is not None:
        raise ServingError(
            f"--hostfile {hostfile}: the two-model form at tp x pp > 1 runs in orchestrator mode, on one node"
        )
    endpoint = endpoint_flags(bind, ports) + restricted_api_flags(new_admin_key())
    return orchestrator_command(repo, gpus_needed(ids), endpoint, tritonserver), "orchestrator"


def repo_device_ids(repo: Path, info: dict) -> Optional[dict[str, str]]:
    """A built TensorRT repository of the two-model form at tp x pp > 1: each model's gpu_device_ids, checked
    against its engine's tp x pp; else None (leader mode)."""
    from trtpipe.triton.orchestrator import DRAFT, TARGET, check_placement, needs_orchestrator, read_device_ids
    from trtpipe.triton.repo import EngineInfo

    world = int(info.get("world_size", 1))
    if not needs_orchestrator(bool(info.get("draft_engine")), world):
        return None
    ids = read_device_ids(repo)
    check_placement(
        ids, {TARGET: world, DRAFT: EngineInfo.read(Path(info["draft_engine"])).world_size}, None, str(repo)
    )
    return ids


def plan_launch(
    repo: Path,
    bind: str = "127.0.0.1",
    ports: Optional[Ports] = None,
    tritonserver: str = "/opt/tritonserver/bin/tritonserver",
    hostfile: Optional[Path] = None,
) -> LaunchPlan:
    info = repo_info(repo)
    if info.get("twin"):
        return LaunchPlan(Path(repo), True, int(info.get("world_size", 1)), None)
    ports = ports or Ports(*free_ports(3))
    world = int(info.get("world_size", 1))
    ids = repo_device_ids(Path(repo), info)
    cmd, mode = engine_launch(Path(repo).resolve(), world, ports, bind, tritonserver, hostfile, ids)
    return LaunchPlan(Path(repo), False, world, cmd, mode)


def twin_orchestrated(plan: LaunchPlan) -> bool:
    """A CPU-twin repository of the two-model form at tp x pp > 1 runs in orchestrator mode, as its TensorRT launch
    does (:mod:`trtpipe.triton.orchestrator`): one tritonserver whose ``tensorrt_llm`` models each start their own
    rank world (:mod:`trtpipe.serving.orchestrator_world`)."""
    return plan.twin and plan.world_size > 1 and bool(repo_info(plan.repo).get("draft_engine"))


def run_mpirun(plan: LaunchPlan) -> int:
    """Run the leader-mode launch in the foreground (TensorRT-LLM container); returns mpirun's exit code."""
    from trtpipe.pipeline.versions import PACKAGES, package_version

    info = repo_info(plan.repo)
    check_engine_versions(
        info, installed_trtllm(), package_version(*PACKAGES["tensorrt"]), engine_lock(Path(info.get("engine", "")))
    )
    from trtpipe.triton.mpi_launch import run_foreground

    return run_foreground(plan.command)


def find_detached(target: Optional[Path] = None, overrides: Sequence[str] = ()) -> list:
    """Detached servers of ``target``: a repository dir, or a recipe (servers of repos under its work dir)."""
    from trtpipe.supervisor import detached_servers

    servers = detached_servers()
    if target is None:
        return servers
    target = Path(target)
    if target.is_file():
        from trtpipe.app.validation import load_recipe

        work = str(load_recipe(target, overrides, check_rules=False).work_path) + "/"
        return [s for s in servers if s.repo.startswith(work)]
    want = str(target.resolve())
    return [s for s in servers if s.repo == want]


def one_detached(target: Optional[Path] = None, overrides: Sequence[str] = ()):
    """The one detached tritonserver of ``target`` (or the only one running) that ``infer`` and ``bench`` talk to."""
    servers = [s for s in find_detached(target, overrides) if s.kind == "tritonserver"]
    if len(servers) != 1:
        where = f" for {target}" if target else ""
        listing = "; ".join(f"pid {s.pid} {s.repo}" for s in servers)
        raise ServingError(
            f"{len(servers)} detached servers run{where}"
            + (f" ({listing})" if listing else "")
            + ": name one (--server REPO_OR_RECIPE) or pass --url"
        )
    return servers[0]


def planned_launch(
    recipe_path: Path,
    overrides: Sequence[str],
    bind: str,
    ports: Optional[Ports],
    tritonserver: str,
    hostfile: Optional[Path] = None,
) -> tuple[LaunchPlan, bool]:
    """The launch of a recipe without building it (``serve RECIPE --dry-run``): the repository path its repo
    stage has or will have, and the TensorRT leader-mode command for the recipe's world size.

    Returns the plan and whether the repository is already built (then it is read, not predicted).
    """
    from trtpipe.pipeline.cache import ArtifactStore
    from trtpipe.pipeline.runner import plan_build
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(recipe_path, overrides)
    plans = plan_build(recipe, STAGES)
    repo_plan = next((p for p in plans if p.name == "repo"), None)
    if repo_plan is None or repo_plan.key is None:
        raise ServingError(
            f"{recipe_path}: the repo stage cannot be planned ({getattr(repo_plan, 'reason', 'absent')})"
        )
    repo = ArtifactStore(recipe.work_path).path("repo", repo_plan.key)
    if repo_plan.cached and (repo / REPO_INFO).exists():
        return plan_launch(repo, bind, ports, tritonserver, hostfile), True
    from trtpipe.triton.orchestrator import check_placement, device_ids, needs_orchestrator
    from trtpipe.triton.repo import two_model

    world = recipe.parallel.world_size
    ports = ports or Ports(*free_ports(3))
    ids = None
    if needs_orchestrator(two_model(recipe), world):  # the draft engine is sharded in the recipe's tp x pp too
        ids = device_ids(world, world)
        check_placement(ids, {m: world for m in ids}, recipe.deploy.gpus_per_node, str(repo))
    cmd, mode = engine_launch(repo, world, ports, bind, tritonserver, hostfile, ids)
    return LaunchPlan(repo, False, world, cmd, mode), False


def dry_run_lines(
    target: Path,
    overrides: Sequence[str],
    bind: str,
    ports: Optional[Ports],
    tritonserver: str,
    hostfile: Optional[Path] = None,
) -> list[str]:
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
    if plan.command is None and plan.world_size > 1 and not twin_orchestrated(plan):
        return lines + _twin_leader_lines(plan, bind, ports, tritonserver, hostfile)
    if plan.command is None:
        root = server_process.server_root()
        cmd = server_process.server_command(
            root / "bin" / "tritonserver", root / "backends", plan.repo, bind, ports or Ports(0, 0, 0), "trtpipe_"
        )
        if twin_orchestrated(plan):
            from trtpipe.triton.orchestrator import ORCHESTRATOR_ENV

            lines += _twin_trt_lines(plan, ports, bind, tritonserver)
            lines.append(
                f"# CPU twin, orchestrator mode: one tritonserver; tensorrt_llm and tensorrt_llm_draft each start "
                f"their own {plan.world_size}-rank mpiexec world (ports 0: free ones are chosen at start)"
            )
            return lines + [shlex.join(["env", *(f"{k}={v}" for k, v in ORCHESTRATOR_ENV.items()), *map(str, cmd)])]
        lines.append("# CPU twin: one tritonserver (ports 0: free ones are chosen at start)")
    elif plan.mode == "orchestrator":
        cmd = plan.command
        lines.append(
            f"# TensorRT engines, orchestrator mode (launch_triton_server.py --multi-model): one tritonserver; the "
            f"backend spawns tensorrt_llm's {plan.world_size} and tensorrt_llm_draft's workers on their gpu_device_ids"
        )
        return lines + [shlex.join(cmd)]
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


def _twin_trt_lines(
    plan: LaunchPlan, ports: Optional[Ports], bind: str, tritonserver: str, hostfile: Optional[Path] = None
) -> list[str]:
    """The launch a CPU-twin repository stands for with TensorRT engines (two comment lines)."""
    import shlex

    ids = None
    if repo_info(plan.repo).get("draft_engine"):  # the two-model form: placed as upstream's guide does
        from trtpipe.triton.orchestrator import device_ids

        ids = device_ids(plan.world_size, plan.world_size)
    ports = ports or Ports(*free_ports(3))
    trt, mode = engine_launch(plan.repo, plan.world_size, ports, bind, tritonserver, None if ids else hostfile, ids)
    return [
        f"# with TensorRT engines (tensorrtllm backend) {mode} mode runs: world_size {plan.world_size}",
        "#   " + shlex.join(trt),
    ]


def _twin_leader_lines(
    plan: LaunchPlan, bind: str, ports: Optional[Ports], tritonserver: str, hostfile: Optional[Path]
) -> list[str]:
    """A CPU-twin tp/pp > 1 repository: the mpiexec job serve runs, then the same launch with TensorRT engines."""
    import shlex

    from trtpipe.triton import mpi_launch

    ports = ports or Ports(*free_ports(3))
    info = repo_info(plan.repo)
    run_dir = Path("<run dir>")
    spec = mpi_launch.launch_spec(plan.repo, info, bind, ports, run_dir, hostfile)
    lines = _twin_trt_lines(plan, ports, bind, tritonserver, hostfile)
    lines += mpi_launch.slurm_lines(spec["segments"])
    lines += [
        f"# CPU twin, leader mode: {plan.world_size} ranks under mpiexec (rank 0 tritonserver + twin executor, "
        f"ranks 1..{plan.world_size - 1} workers); serve runs it under a supervisor (run dir in the cache)",
        shlex.join(spec["command"]),
    ]
    return lines


# --- trtpipe serve / trtpipe stop ------------------------------------------------------------------------------


def has_warmup(repo: Path) -> bool:
    """Whether the repository's models declare ``model_warmup`` (run before the server reports ready)."""
    return any("model_warmup" in p.read_text() for p in Path(repo).glob("*/config.pbtxt"))


def requested_ports(http: Optional[int], grpc: Optional[int], metrics: Optional[int]) -> Optional[Ports]:
    """The ports asked for, free ones filling the gaps; None when none was asked for (the server picks)."""
    if http is None and grpc is None and metrics is None:
        return None
    free = iter(free_ports(3))
    return Ports(http or next(free), grpc or next(free), metrics or next(free))


def serve_repository(
    target: Path,
    overrides: Sequence[str],
    bind: Optional[str],
    http_port: Optional[int],
    grpc_port: Optional[int],
    metrics_port: Optional[int],
    timeout: float,
    detach: bool,
    dry_run: bool,
    tritonserver: str,
    hostfile: Optional[Path],
    single_process: bool,
    echo: Callable[..., None],
) -> int:
    """``trtpipe serve`` of a Triton repository or an engine recipe (built first): print the dry-run launch, run
    mpirun (TensorRT engines), or start the CPU twin (one tritonserver, or leader mode under mpiexec) and serve
    until Ctrl-C, or return once it is ready (``detach``). Returns the exit status."""
    import time

    from trtpipe.triton import server_process

    if Path(target).is_file():  # a recipe: its triton section gives the defaults
        from trtpipe.app.validation import load_recipe

        t = load_recipe(target, overrides).triton
        bind = bind or t.bind
        http_port, grpc_port, metrics_port = (
            http_port or t.http_port,
            grpc_port or t.grpc_port,
            metrics_port or t.metrics_port,
        )
    bind = bind or "127.0.0.1"
    if server_process.exposure_warning(bind):
        echo(server_process.exposure_warning(bind), err=True)
    ports = requested_ports(http_port, grpc_port, metrics_port)
    if dry_run:
        echo("\n".join(dry_run_lines(target, overrides, bind, ports, tritonserver, hostfile)))
        return 0
    repo = resolve_repo(target, overrides)
    plan = plan_launch(repo, bind, ports, tritonserver, hostfile)
    if plan.command is not None:
        return run_mpirun(plan)
    sigterm_as_interrupt()
    t0 = time.perf_counter()
    orchestrated = twin_orchestrated(plan) and not single_process
    if orchestrated:  # as TensorRT-LLM runs it: one tritonserver, each TensorRT-LLM model spawns its own ranks
        import os

        from trtpipe.triton.orchestrator import ORCHESTRATOR_ENV

        os.environ.update(ORCHESTRATOR_ENV)
    elif plan.world_size > 1 and not single_process:  # leader mode: one process per rank under mpiexec
        from trtpipe.triton import mpi_launch

        server, state = mpi_launch.start_job(
            repo, repo_info(repo), bind, ports or Ports(*free_ports(3)), timeout, hostfile, detach
        )
        lines = [
            f"serving {repo} (leader mode, {plan.world_size} ranks under mpiexec)\n  http {server.http_url}\n"
            f"  grpc {server.grpc_url}\n  run  {server.run_dir}\n  ready in {time.perf_counter() - t0:.1f} s"
        ]
        lines += [
            f"  rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}) pid {r['pid']} on {r['host']}: "
            f"layers {r['layers']}, {r['weights_mb']} MiB of weights, RSS {r['rss_mb']} MiB"
            for r in state.get("ranks", [])
        ]
        if not _announce(server, lines, repo, detach, echo):
            return 0
        return mpi_launch.serve_job_forever(server, server.run_dir)
    server = server_process.start_server(repo, bind, ports, timeout=timeout, detach=detach)
    ready_s = time.perf_counter() - t0
    mode = f" (orchestrator mode: each TensorRT-LLM model runs {plan.world_size} ranks)" if orchestrated else ""
    lines = [
        f"serving {repo}{mode}\n  http {server.http_url}\n  grpc {server.grpc_url}\n  metrics http://{server.bind}:"
        f"{server.ports.metrics}/metrics\n  log  {server.log}\n  ready in {ready_s:.1f} s (models loaded"
        f"{' and warmed up' if has_warmup(repo) else ', no warm-up'})"
    ]
    if not _announce(server, lines, repo, detach, echo):
        return 0
    server_process.serve_forever(server)
    echo("stopped")
    return 0


def _announce(server, lines: list[str], repo: Path, detach: bool, echo: Callable[[str], None]) -> bool:
    """Print what was started; True when the caller should now wait in the foreground. A Ctrl-C that lands while
    printing (before that wait began) stops the server: it runs in a session of its own and would outlive us."""
    try:
        for line in lines:
            echo(line)
        if detach:
            echo(f"  pid  {server.pid} (trtpipe stop {repo})")
            return False
        echo("Ctrl-C to stop")
        sys.stdout.flush()
        return True
    except KeyboardInterrupt:
        if not detach:
            server.stop()
        return False


def stop_servers(target: Optional[Path], overrides: Sequence[str], echo: Callable[[str], None]) -> None:
    """``trtpipe stop``: stop the detached servers of ``target`` (a repository, model dir or recipe; any kind),
    or the only one running."""
    servers = find_detached(target, overrides)
    if target is None and len(servers) > 1:
        raise ServingError(f"{len(servers)} detached servers run; name one: " + ", ".join(s.repo for s in servers))
    if not servers:
        echo("no detached server is running" + (f" for {target}" if target else ""))
    for s in servers:
        s.stop()
        echo(f"stopped pid {s.pid} ({s.repo})")


def write_repository(
    recipe_path: Path,
    overrides: Sequence[str],
    engine_dir: Optional[Path],
    tokenizer_dir: Optional[Path],
    out: Optional[Path],
) -> str:
    """``trtpipe repo``: build the recipe up to its repo stage (then copy it to ``out`` or triton.repo_dir when
    one is given), or write a repository for ``engine_dir``. Returns what to print: the repository path (with
    its models when written from an engine dir)."""
    from trtpipe.app.validation import load_recipe
    from trtpipe.triton.repo import export_repo, write_repo

    loaded = load_recipe(recipe_path, overrides)
    if engine_dir is None:
        built = resolve_repo(recipe_path, overrides)
        if loaded.triton.repo_dir or out:
            built = export_repo(built, out or loaded.resolve(loaded.triton.repo_dir))
        return str(built)
    out = out or loaded.resolve(loaded.triton.repo_dir or str(loaded.work_path / "repo"))
    configs = write_repo(loaded, engine_dir, tokenizer_dir or engine_dir / "checkpoint", out)
    return f"{out} ({', '.join(sorted(configs))})"


def client_url(url: Optional[str], protocol: str, server: Optional[Path] = None, overrides: Sequence[str] = ()) -> str:
    """Where ``trtpipe infer`` connects: ``url`` as given, else the gRPC or HTTP address of the detached server
    (of ``server``, a repository or recipe, or the only one running)."""
    if url:
        return url
    s = one_detached(server, overrides)
    return s.grpc_url if protocol == "grpc" else s.http_url.split("://", 1)[1]
