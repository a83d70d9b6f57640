"""What ``trtpipe serve`` runs for a ``target: llmapi`` recipe (or an HF checkpoint directory): the OpenAI twin.

The llmapi target deploys with ``trtllm-serve`` (an OpenAI-compatible server), not with a Triton repository, so
``trtpipe serve`` serves its export with :mod:`trtpipe.serving.openai_server`, the CPU twin of trtllm-serve.
In the foreground it runs in this process until Ctrl-C. With ``--detach`` it runs as a child process (this same
command without ``--detach``, its output in a log file) recorded in the state directory ``trtpipe stop`` reads,
as a :class:`~trtpipe.supervisor.Server` of kind ``openai`` whose ``repo`` is the model directory.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from trtpipe.errors import ServingError
from trtpipe.serving.adapters import LoraSettings
from trtpipe.jsonfile import load_json
from trtpipe.serving.api import ExecutorConfig
from trtpipe.app.launch_triton import REPO_INFO
from trtpipe.processes import cache_dir, log_tail
from trtpipe.supervisor import READY_TIMEOUT_S, Ports, Server, await_ready, refuse_if_served, start

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
log = logging.getLogger("trtpipe.openai")


@dataclass
class OpenAITarget:
    """What the twin serves: the model directory, the name clients send, where it listens, its limits."""

    source: Path  # the recipe file or HF directory the user named
    model_dir: Path
    name: str
    host: str
    port: int
    config: Optional[ExecutorConfig] = None  # None: the twin's defaults (an HF directory has no engine section)
    chat_template: Optional[Path] = None
    tool_parser: Optional[str] = None  # trtllm-serve's parser names (a recipe's serving.*_parser, or its family's)
    reasoning_parser: Optional[str] = None
    lora: Optional[LoraSettings] = None  # the recipe's LoRA adapters (None: none)


def is_openai_target(target: Path, overrides: Sequence[str] = ()) -> bool:
    """True for a ``target: llmapi`` recipe, or a directory holding an HF checkpoint rather than a Triton
    repository (``trtpipe serve`` serves both with the OpenAI twin)."""
    target = Path(target)
    if target.is_dir():
        return (target / "config.json").is_file() and not (target / REPO_INFO).exists()
    from trtpipe.app.validation import load_recipe

    return target.is_file() and load_recipe(target, overrides, check_rules=False).target == "llmapi"


def resolve_openai_target(
    target: Path,
    overrides: Sequence[str] = (),
    host: Optional[str] = None,
    port: Optional[int] = None,
    name: Optional[str] = None,
    chat_template: Optional[Path] = None,
) -> OpenAITarget:
    """An HF directory as is; an llmapi recipe is built up to its export (cached stages reused), and its
    ``llmapi`` section gives the defaults of name, host and port, its engine section the executor's limits."""
    from trtpipe.export.serving import served_parsers
    from trtpipe.serving.config import from_recipe

    target = Path(target)
    if target.is_dir():
        return OpenAITarget(
            target,
            target.resolve(),
            name or target.name,
            host or DEFAULT_HOST,
            port or DEFAULT_PORT,
            None,
            chat_template,
        )
    from trtpipe.pipeline.runner import run_build
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(target, overrides)
    if recipe.target != "llmapi":
        raise ServingError(
            f"{target}: target is {recipe.target}; the OpenAI twin serves target: llmapi recipes "
            "(trtpipe serve serves the Triton repository of this one)"
        )
    model_dir = run_build(recipe, STAGES, (), None, "export", overrides=overrides).artifact("export") / "hf"
    max_pos = load_json(model_dir / "config.json", ServingError).get("max_position_embeddings") or 2048
    parsers = {k: twin_parser(p) for k, p in served_parsers(recipe).items()}
    lora = None
    if recipe.lora.adapters:
        from trtpipe.export.lora import adapter_dirs

        lora = LoraSettings(
            adapter_dirs(recipe), recipe.lora.max_lora_rank, recipe.lora.max_loras, recipe.lora.max_cpu_loras
        )
    return OpenAITarget(
        target,
        model_dir.resolve(),
        name or recipe.llmapi.served_model_name or recipe.name,
        host or recipe.llmapi.host,
        port or recipe.llmapi.port,
        from_recipe(recipe, int(max_pos)),
        chat_template,
        parsers["tool_parser"],
        parsers["reasoning_parser"],
        lora,
    )


def twin_parser(parser) -> Optional[str]:
    """The name the twin runs a deployment's parser by: trtllm-serve's (the twin stands in for it), when
    trtllm-serve has the parser (by flag, or by itself for the family: gpt-oss's harmony) and the twin implements
    it; otherwise none, as trtllm-serve would run none."""
    if parser is None or (parser.trtllm is None and not parser.builtin):
        return None
    if not parser.twin:
        log.warning("the OpenAI twin does not run the %s parser: answers are not split by it", parser.name)
        return None
    return parser.trtllm or parser.name


def serve_foreground(t: OpenAITarget) -> None:
    """Serve until Ctrl-C or SIGTERM (blocking), logging requests to stderr."""
    from trtpipe.serving.openai_server import serve

    template = t.chat_template.read_text() if t.chat_template else None
    serve(
        t.model_dir,
        t.host,
        t.port,
        t.name,
        t.config,
        template,
        tool_parser=t.tool_parser,
        reasoning_parser=t.reasoning_parser,
        lora=t.lora,
    )


def child_command(t: OpenAITarget, overrides: Sequence[str]) -> list[str]:
    """The foreground ``trtpipe serve`` the detached child runs (the build is cached by then)."""
    cmd = [sys.executable, "-m", "trtpipe.cli", "serve", str(t.source)]
    for o in overrides:
        cmd += ["--set", o]
    cmd += ["--bind", t.host, "--http-port", str(t.port), "--served-model-name", t.name]
    if t.chat_template:
        cmd += ["--chat-template", str(t.chat_template)]
    return cmd


def start_detached(t: OpenAITarget, overrides: Sequence[str] = (), timeout: float = READY_TIMEOUT_S) -> Server:
    """Start the twin as a child process, wait until ``/health`` answers, record it for ``trtpipe stop``."""
    state = refuse_if_served(t.model_dir)  # one state file per served directory, whichever launcher started it
    log = cache_dir() / "logs" / f"{t.name.replace('/', '_')}-{state.stem}.openai.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start(
        child_command(t, overrides),
        log,
        t.model_dir,
        t.host,
        Ports(t.port, 0, 0),
        "openai",
        "trtpipe-openai{pid}_",
        env=dict(os.environ),
        truncate=True,
    )
    why = await_ready(server, timeout)  # stops the child when it is not ready, Ctrl-C included
    if why:
        raise ServingError(f"the OpenAI twin on {t.model_dir} {why}; log {log}:\n{log_tail(log)}")
    server.detach(state)
    return server


def serve_openai(
    target: Path,
    overrides: Sequence[str],
    host: Optional[str],
    port: Optional[int],
    name: Optional[str],
    chat_template: Optional[Path],
    detach: bool,
    timeout: float,
    echo: Callable[[str], None],
) -> None:
    """``trtpipe serve`` of an OpenAI target: in the foreground, or detached with what it started printed."""
    if not detach:  # the server logs its requests, and the build its stages, to stderr (as serve-openai always did)
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    t = resolve_openai_target(target, overrides, host, port, name, chat_template)
    if not detach:
        serve_foreground(t)
        return
    t0 = time.perf_counter()
    server = start_detached(t, overrides, timeout)
    echo(
        f"serving {t.model_dir} as {t.name!r} (OpenAI-compatible twin of trtllm-serve)\n"
        f"  http {server.http_url}/v1\n  log  {server.log}\n  ready in {time.perf_counter() - t0:.1f} s\n"
        f"  pid  {server.pid} (trtpipe stop {target})"
    )
