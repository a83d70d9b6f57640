"""``trtpipe serve --dynamo``: NVIDIA Dynamo's real frontend and router in front of N twin workers, on one host.

The graph is the one Dynamo documents for a host without etcd or NATS (ai-dynamo 1.6.1): discovery in files
(``DYN_DISCOVERY_BACKEND=file``, a directory of this run's own), requests over TCP, KV events over ZMQ. Every
listener Dynamo lets us place is bound to the loopback address; its workers' ZMQ event publishers are not (1.6.1
binds them to all interfaces whatever ``DYN_EVENT_PLANE_HOST`` says: that variable sets only the address it
advertises), so :meth:`DynamoGraph.describe_ports` says so, and the tests run the graph in a network namespace.

The :class:`Supervisor` owns the processes: it starts the frontend, then the workers (each with its own system
port, log and, where the machine has the cores, its own CPU), waits until every worker has registered and the
model is listed (the frontend's ``/health`` says 200 before any worker exists, so it is no readiness signal),
then watches. A worker that dies is named from its exit status (the supervisor is its parent: no guessing), its
discovery records are removed so the router stops choosing it, and the others keep serving. Stopping (Ctrl-C,
SIGTERM, ``trtpipe stop``) ends workers first, then the frontend, then removes the discovery directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from trtpipe.deploy.dynamo import ROUTERS
from trtpipe.errors import ServingError
from trtpipe.processes import log_tail, write_state
from trtpipe.serving.api import ExecutorConfig
from trtpipe.serving.config import from_json, replace_knobs, to_json, twin_default
from trtpipe.supervisor import Member, exit_cause, listed_models, spawn_member, stop_in_order
from trtpipe.jsonfile import load_json

DYNAMO_PYTHON_ENV = "TRTPIPE_DYNAMO_PYTHON"
READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 15.0  # a worker's own shutdown waits 5 s before draining (Dynamo's grace period), then cleans up
SYSTEM_PORT_RANGE = (20000, 32768)
LOOPBACK = "127.0.0.1"
WORKER_STATUS = "worker{}.json"  # what a worker writes about itself once started (pid, Dynamo instance id)


def dynamo_python() -> Path:
    """The interpreter of Dynamo's venv: $TRTPIPE_DYNAMO_PYTHON, else ``.venv-dynamo`` of this checkout."""
    configured = os.environ.get(DYNAMO_PYTHON_ENV)
    candidates = (
        [Path(configured)] if configured else [Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"]
    )
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise ServingError(
        f"serve --dynamo needs NVIDIA Dynamo in its own venv: not found at {candidates[0]} "
        f"(install it with scripts/install_dynamo.sh, or set {DYNAMO_PYTHON_ENV})"
    )


@dataclass
class DynamoGraph:
    """What to start: one frontend and ``replicas`` workers over one exported checkpoint."""

    model_dir: Path
    name: str
    replicas: int
    router: str
    host: str
    port: int
    config: ExecutorConfig
    run_dir: Path
    threads_per_worker: int = 1
    chat_template: Optional[str] = None  # for a tokenizer without one (Dynamo serves chat only with a template)
    system_ports: list[int] = field(default_factory=list)
    parser_args: list[str] = field(default_factory=list)  # --dyn-tool-call-parser / --dyn-reasoning-parser
    frontend_port: int = 0  # Dynamo's frontend, on loopback behind the ingress (chosen at start)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ServingError(f"--router {self.router!r}: expected one of {', '.join(ROUTERS)}")
        if self.replicas < 1:
            raise ServingError(f"--replicas {self.replicas}: need at least one worker")

    @property
    def endpoint_types(self) -> str:
        return "chat,completions" if self.chat_template or has_chat_template(self.model_dir) else "completions"

    @property
    def worker_model_dir(self) -> Path:
        """What workers load and Dynamo reads the tokenizer from: the export, or (with a chat template given) a
        directory of links to it whose ``tokenizer_config.json`` carries the template."""
        return self.run_dir / "model" if self.chat_template else self.model_dir

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict:
        """The environment of every process of the graph: file discovery in this run, loopback everywhere."""
        h = self.host
        return {
            **os.environ,
            "DYN_DISCOVERY_BACKEND": "file",
            "DYN_FILE_KV": str(self.run_dir / "discovery"),
            "DYN_NAMESPACE": "dynamo",
            "DYN_HTTP_HOST": LOOPBACK,  # behind the ingress: only it talks to the frontend
            "DYN_HTTP_PORT": str(self.frontend_port),
            "DYN_TCP_RPC_HOST": h,
            "DYN_SYSTEM_HOST": h,
            "DYN_TCP_RESPONSE_STREAM_HOST": h,
            "DYN_EVENT_PLANE_HOST": h,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def frontend_command(self, python: Path) -> list[str]:
        return [str(python), "-m", "dynamo.frontend", "--router-mode", self.router]

    def ingress_command(self, python: Path) -> list[str]:
        """trtpipe's completions ingress on the public port (trtpipe.serving.dynamo_ingress: a text completion
        reaches Dynamo encoded as trtllm-serve encodes it, BOS included), in front of the frontend."""
        return [
            str(python),
            "-m",
            "trtpipe.serving.dynamo_ingress",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--upstream",
            f"http://{LOOPBACK}:{self.frontend_port}",
            "--model",
            str(self.worker_model_dir),
            "--max-seq-len",
            str(self.config.max_seq_len),
        ]

    def worker_command(self, python: Path, index: int) -> list[str]:
        cmd = [
            str(python),
            "-m",
            "trtpipe.serving.dynamo_worker",
            "--model",
            str(self.worker_model_dir),
            "--served-model-name",
            self.name,
            "--executor-config",
            to_json(self.config),
            "--threads",
            str(self.threads_per_worker),
            "--endpoint-types",
            self.endpoint_types,
            "--status-file",
            str(self.run_dir / WORKER_STATUS.format(index)),
            *self.parser_args,
        ]
        cores = worker_cores(index, self.replicas)
        if cores and shutil.which("taskset"):
            cmd = ["taskset", "-c", ",".join(map(str, cores))] + cmd
        return cmd

    def describe_ports(self) -> str:
        return (
            f"http {self.url} (OpenAI API: trtpipe's completions ingress, in front of Dynamo's frontend on "
            f"{LOOPBACK}:{self.frontend_port}); each worker: a system port on {self.host} "
            f"({', '.join(map(str, self.system_ports))}), a request-plane port on {self.host}, and three ZMQ "
            "KV-event publishers that Dynamo 1.6.1 binds to 0.0.0.0 (firewall them, or run in a network "
            "namespace)"
        )


def worker_cores(index: int, replicas: int) -> list[int]:
    """The CPUs worker ``index`` is pinned to: its own when the machine has one per worker, else none (shared)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < replicas:
        return []
    share = len(cpus) // replicas
    return cpus[index * share : (index + 1) * share]


def free_port(host: str) -> int:
    """A port free a moment ago on ``host`` (the kernel's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def low_free_ports(n: int, host: str) -> list[int]:
    """``n`` ports free a moment ago, below 32768: Dynamo 1.6.1 parses ``DYN_SYSTEM_PORT`` as a signed 16-bit int
    ("invalid value unsigned int `56095`, expected i16"), so the kernel's ephemeral range (from 32768) is out."""
    rng, found = random.Random(os.getpid()), []
    for port in rng.sample(range(*SYSTEM_PORT_RANGE), SYSTEM_PORT_RANGE[1] - SYSTEM_PORT_RANGE[0]):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise ServingError(f"no {n} free ports in {SYSTEM_PORT_RANGE} on {host} for the workers' system servers")


class Supervisor:
    """Start, watch and stop one :class:`DynamoGraph`; its state is ``run_dir/status.json`` for other processes."""

    def __init__(self, graph: DynamoGraph, echo: Callable[[str], None] = print):
        self.graph, self.echo = graph, echo
        self.python = dynamo_python()
        self.frontend: Optional[Member] = None
        self.ingress: Optional[Member] = None
        self.workers: list[Member] = []
        self.events: list[str] = []

    # ---- start ------------------------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT_S) -> None:
        g = self.graph
        if g.run_dir.exists():
            shutil.rmtree(g.run_dir)
        (g.run_dir / "discovery").mkdir(parents=True)
        if g.chat_template:
            link_model_with_template(g.model_dir, g.worker_model_dir, g.chat_template)
        ports = low_free_ports(g.replicas, g.host)
        g.system_ports = ports
        g.frontend_port = free_port(LOOPBACK)
        try:
            self.frontend = self._spawn("frontend", g.frontend_command(self.python), {})
            self.ingress = self._spawn("ingress", g.ingress_command(self.python), {})
            for i in range(g.replicas):
                w = self._spawn(f"worker{i}", g.worker_command(self.python, i), {"DYN_SYSTEM_PORT": str(ports[i])})
                w.system_port = ports[i]
                self.workers.append(w)
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise
        self._write_status("ready")

    def _spawn(self, role: str, cmd: list[str], extra_env: dict) -> Member:
        return spawn_member(
            role, cmd, self.graph.run_dir / f"{role}.log", {**self.graph.env(), **extra_env}, self.graph.run_dir
        )

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            for m in [self.frontend, self.ingress, *self.workers]:
                if not m.alive():
                    raise ServingError(
                        f"dynamo {m.role} (pid {m.pid}) {exit_cause(m.proc.returncode)} during "
                        f"start-up; log {m.log}:\n{log_tail(m.log)}"
                    )
            if len(self.registered()) == self.graph.replicas and self.graph.name in listed_models(self.graph.url):
                return
            time.sleep(0.25)
        raise ServingError(
            f"dynamo graph not ready after {deadline:.0f} s: {len(self.registered())} of "
            f"{self.graph.replicas} workers registered; logs in {self.graph.run_dir}"
        )

    def registered(self) -> dict[int, dict]:
        """Worker index -> what it wrote about itself (its pid and Dynamo instance id), for the started ones."""
        out = {}
        for i in range(self.graph.replicas):
            f = self.graph.run_dir / WORKER_STATUS.format(i)
            try:
                out[i] = load_json(f)
            except (OSError, ValueError):
                continue
        return out

    # ---- watch ------------------------------------------------------------------------------------
    def poll(self) -> list[str]:
        """Notice members that ended since the last call; take dead workers out of routing. Returns new events."""
        new = []
        for m in [self.frontend, self.ingress, *self.workers]:
            if m is None or not m.notice_end():
                continue
            line = f"dynamo {m.role} (pid {m.pid}) died: {m.cause}"
            if m.role.startswith("worker"):
                removed = self._unregister(int(m.role[len("worker") :]))
                alive = sum(1 for w in self.workers if w.alive())
                line += f"; {removed} discovery records removed; {alive} of {len(self.workers)} workers serving"
            new.append(line)
        if new:
            self.events.extend(new)
            for line in new:
                self.echo(line)
            self._write_status(
                "ready"
                if self.frontend.cause is None
                and self.ingress.cause is None
                and any(w.cause is None for w in self.workers)
                else "failed"
            )
        return new

    def _unregister(self, index: int) -> int:
        """Remove the discovery records of worker ``index`` (a killed worker cannot remove its own)."""
        me = self.registered().get(index)
        if not me:
            return 0
        token = format(int(me["instance_id"]), "x")
        removed = 0
        for f in (self.graph.run_dir / "discovery").rglob("*"):
            if f.is_file() and urllib.parse.unquote(f.name).endswith(token):
                f.unlink(missing_ok=True)
                removed += 1
        return removed

    def run_until_stopped(self) -> None:
        """Watch until SIGTERM / Ctrl-C (or the frontend dies), then stop everything."""
        from trtpipe.processes import sigterm_as_interrupt

        sigterm_as_interrupt()
        try:
            while self.frontend.cause is None and self.ingress.cause is None:
                self.poll()
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    # ---- stop -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Workers first (they unregister and drain), then the frontend, then the ingress; SIGKILL whatever outlives
        the grace."""
        stop_in_order(
            (self.workers, [m for m in (self.frontend,) if m], [m for m in (self.ingress,) if m]), STOP_GRACE_S
        )
        shutil.rmtree(self.graph.run_dir / "discovery", ignore_errors=True)
        if self.graph.run_dir.exists():
            self._write_status("stopped")

    def _write_status(self, state: str) -> None:
        members = [self.frontend, self.ingress, *self.workers]
        write_state(
            self.graph.run_dir / "status.json",
            {
                "state": state,
                "url": self.graph.url,
                "model": self.graph.name,
                "router": self.graph.router,
                "members": [
                    {"role": m.role, "pid": m.pid, "log": str(m.log), "cause": m.cause, "system_port": m.system_port}
                    for m in members
                    if m is not None
                ],
                "events": self.events,
            },
        )


def graph_spec(g: DynamoGraph) -> dict:
    return {
        "model_dir": str(g.model_dir),
        "name": g.name,
        "replicas": g.replicas,
        "router": g.router,
        "host": g.host,
        "port": g.port,
        "config": to_json(g.config),
        "run_dir": str(g.run_dir),
        "threads_per_worker": g.threads_per_worker,
        "chat_template": g.chat_template,
        "parser_args": g.parser_args,
    }


def graph_from_spec(spec: dict) -> DynamoGraph:
    return DynamoGraph(
        **{
            **spec,
            "model_dir": Path(spec["model_dir"]),
            "run_dir": Path(spec["run_dir"]),
            "config": from_json(spec["config"]),
        }
    )


def resolve_graph(
    target: Path,
    overrides,
    host: Optional[str],
    port: Optional[int],
    name: Optional[str],
    replicas: int,
    router: str,
    chat_template: Optional[Path] = None,
) -> DynamoGraph:
    """The graph of an llmapi recipe (built up to its export) or an exported HF directory."""
    from trtpipe.processes import cache_dir
    from trtpipe.app.launch_openai import resolve_openai_target
    from trtpipe.supervisor import state_path

    if Path(target).is_file():  # before any build: Dynamo cannot serve a recipe's LoRA adapters on TensorRT-LLM
        from trtpipe.app.validation import load_recipe
        from trtpipe.export.lora import dynamo_refusal

        refusal = dynamo_refusal(load_recipe(target, overrides, check_rules=False))
        if refusal:
            raise ServingError(f"{target}: {refusal}")
    t = resolve_openai_target(target, overrides, host, port, name)
    max_pos = load_json(t.model_dir / "config.json", ServingError).get("max_position_embeddings") or 2048
    config = replace_knobs(t.config or twin_default(int(max_pos)), enable_kv_cache_reuse=True)  # what KV routing is for
    return DynamoGraph(
        t.model_dir,
        t.name,
        replicas,
        router,
        t.host,
        t.port,
        config,
        cache_dir() / "dynamo" / state_path(t.model_dir).stem,
        chat_template=chat_template.read_text() if chat_template else None,
        parser_args=recipe_parser_args(Path(target), overrides),
    )


def recipe_parser_args(target: Path, overrides) -> list[str]:
    """The Dynamo parser flags of an llmapi recipe (its serving.*_parser, else its family's defaults, in Dynamo's
    names); none for an HF directory served as it is."""
    if target.is_dir():
        return []
    from trtpipe.app.validation import load_recipe
    from trtpipe.deploy.dynamo import dynamo_parser_args

    return dynamo_parser_args(load_recipe(target, overrides))


def has_chat_template(model_dir: Path) -> bool:
    cfg = Path(model_dir) / "tokenizer_config.json"
    return (Path(model_dir) / "chat_template.jinja").is_file() or bool(
        cfg.is_file() and load_json(cfg, ServingError).get("chat_template")
    )


def link_model_with_template(model_dir: Path, out: Path, template: str) -> None:
    """``out``: links to every file of ``model_dir`` but ``tokenizer_config.json``, rewritten with ``template``
    (as ``trtllm-serve --chat_template`` overrides the tokenizer's; the export itself stays untouched)."""
    out.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.name != "tokenizer_config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg_file = Path(model_dir) / "tokenizer_config.json"
    cfg = load_json(cfg_file, ServingError) if cfg_file.is_file() else {}
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}, indent=1))


def serve_dynamo(
    target: Path,
    overrides,
    host: Optional[str],
    port: Optional[int],
    name: Optional[str],
    replicas: int,
    router: str,
    chat_template: Optional[Path],
    detach: bool,
    timeout: float,
    echo: Callable[[str], None],
) -> None:
    """``trtpipe serve --dynamo``: in the foreground until Ctrl-C, or detached and recorded for ``trtpipe stop``."""
    from trtpipe.processes import cache_dir
    from trtpipe.supervisor import Ports, await_ready, refuse_if_served, start

    dynamo_python()  # before any build: say at once how to get Dynamo when it is missing
    g = resolve_graph(target, overrides, host, port, name, replicas, router, chat_template)
    state = refuse_if_served(g.model_dir)
    if not detach:
        sup = Supervisor(g, echo)
        sup.start(timeout)
        echo(announce(g))
        sup.run_until_stopped()
        return
    g.run_dir.parent.mkdir(parents=True, exist_ok=True)
    spec = g.run_dir.parent / f"{g.run_dir.name}.graph.json"
    write_state(spec, graph_spec(g))
    log = cache_dir() / "logs" / f"{g.name.replace('/', '_')}-{state.stem}.dynamo.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start(
        [sys.executable, "-m", "trtpipe.app.launch_dynamo", str(spec)],
        log,
        g.model_dir,
        g.host,
        Ports(g.port, 0, 0),
        "dynamo",
        "trtpipe-dynamo{pid}_",
    )
    why = await_ready(server, timeout + STOP_GRACE_S, lambda: (run_status(g.run_dir) or {}).get("state") == "ready")
    if why:
        raise ServingError(f"the Dynamo graph on {g.model_dir} {why}; log {log}:\n{log_tail(log)}")
    server.detach(state)  # stops the graph when it cannot be recorded
    g.system_ports = [m["system_port"] for m in run_status(g.run_dir)["members"] if m["system_port"]]
    echo(announce(g) + f"\n  log  {log}\n  pid  {server.pid} (trtpipe stop {target})")


def announce(g: DynamoGraph) -> str:
    return (
        f"serving {g.model_dir} as {g.name!r} on NVIDIA Dynamo: frontend + {g.replicas} twin workers "
        "(completions encoded as trtllm-serve encodes them, BOS included, by trtpipe's ingress), "
        f"router {g.router}\n  http {g.url}/v1\n  ports {g.describe_ports()}\n  run  {g.run_dir}"
    )


def run_status(run_dir: Path) -> Optional[dict]:
    from trtpipe.processes import read_state

    return read_state(Path(run_dir) / "status.json")


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m trtpipe.app.launch_dynamo GRAPH.json``: supervise a graph in the foreground (serve
    --dynamo --detach runs this as its child)."""
    graph = graph_from_spec(load_json(Path((argv or sys.argv[1:])[0]), ServingError))
    sup = Supervisor(graph, echo=lambda s: print(s, flush=True))
    try:
        sup.start()
    except ServingError as exc:
        print(exc, flush=True)
        sup._write_status("failed")
        sys.exit(1)
    print(announce(graph), flush=True)
    sup.run_until_stopped()


if __name__ == "__main__":
    main()
