"""Find (or start) the server a benchmark talks to: ``--url``, a detached server of a repository or recipe,
or, for a recipe nobody serves yet, a server started for the benchmark's duration and stopped after it."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Sequence

from trtpipe.bench.metrics import BenchError
from trtpipe.bench.target import Target, resolve_target


@contextmanager
def bench_target(
    target: Optional[Path] = None,
    overrides: Sequence[str] = (),
    url: Optional[str] = None,
    model: Optional[str] = None,
    tokenizer: Optional[str] = None,
    metrics_url: Optional[str] = None,
    log=None,
) -> Iterator[tuple[Target, object]]:
    """Yield ``(Target, recipe or None)``.

    Args:
        target: a recipe file or a model repository directory (served detached, or started here if a recipe).
        url: HTTP ``host:port`` of a running server instead (then ``tokenizer`` is needed).
        metrics_url: tritonserver's metrics endpoint (default: the detached server's metrics port).
    """
    say = log or (lambda msg: print(msg, file=sys.stderr))
    recipe = None
    if target is not None and Path(target).is_file():
        from trtpipe.app.validation import load_recipe

        recipe = load_recipe(target, overrides)
    if url:  # a running server; a repository or recipe given too supplies tokenizer, limits and provenance
        repo = None
        if target is not None:
            from trtpipe.app.launch_triton import resolve_repo

            repo = Path(target) if Path(target).is_dir() else resolve_repo(target, overrides, quiet=True)
        yield resolve_target(url, tokenizer, model, metrics_url, repo, recipe.name if recipe else None), recipe
        return
    if target is None:
        raise BenchError("name a recipe or repository to benchmark, or pass --url (with --tokenizer)")
    from trtpipe.app.launch_triton import find_detached, resolve_repo

    servers = find_detached(target, overrides)
    if recipe is not None and servers:  # only servers of this recipe's current repository
        repo = resolve_repo(target, overrides, quiet=True)
        servers = [s for s in servers if Path(s.repo) == Path(repo)]
    if len(servers) > 1:
        raise BenchError(f"{len(servers)} detached servers serve {target}: pass --url")
    if servers:
        s = servers[0]
        yield (
            resolve_target(
                s.http_url,
                tokenizer,
                model,
                metrics_url or f"http://{s.bind}:{s.ports.metrics}/metrics",
                Path(s.repo),
                recipe.name if recipe else None,
            ),
            recipe,
        )
        return
    if recipe is None:
        raise BenchError(f"{target}: no detached server serves this repository (trtpipe serve {target} --detach)")
    from trtpipe.triton.server_process import start_server

    repo = resolve_repo(target, overrides, quiet=True)
    say(f"no server runs {target}: starting one on {repo} for this benchmark")
    with start_server(repo) as s:
        yield (
            resolve_target(
                s.http_url,
                tokenizer,
                model,
                metrics_url or f"http://{s.bind}:{s.ports.metrics}/metrics",
                Path(s.repo),
                recipe.name,
            ),
            recipe,
        )
