"""``trtpipe eval``: the verify stage's accuracy report (the build up to it), or with ``--harness lm-eval`` the
deployment and its unquantized reference scored by lm-evaluation-harness (:mod:`trtpipe.app.harness`)."""

from __future__ import annotations

from pathlib import Path

import click

from trtpipe.app.options import OVERRIDES, build_until


def _tasks(ctx, param, value):
    if value is None:
        return None
    tasks = [t.strip() for t in value.split(",") if t.strip()]
    if not tasks:
        raise click.BadParameter(f"expected comma-separated task names, got {value!r}")
    return tasks


@click.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the table.")
@click.option(
    "--harness",
    type=click.Choice(["lm-eval"]),
    help="Serve the deployment and its unquantized reference (target: llmapi) and score both with this harness.",
)
@click.option("--tasks", callback=_tasks, metavar="T[,T..]", help="The harness's tasks (shipped: tasks/lm_eval).")
@click.option(
    "--include-path",
    "include_paths",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A directory of lm-evaluation-harness task YAMLs, beside the shipped ones (repeatable).",
)
@click.option("--limit", type=click.IntRange(min=1), help="Score only the first N documents of each task.")
@click.option(
    "--max-drop",
    type=float,
    help="Fail a task whose main metric drops by more than this plus 2 standard errors (absolute, e.g. 0.02).",
)
def eval_(recipe: Path, overrides, as_json: bool, harness, tasks, include_paths, limit, max_drop) -> None:
    """Accuracy report of the quantized model against the unquantized one; fails when the recipe's gate does."""
    if harness is None:
        given = [n for n, v in (("--tasks", tasks), ("--include-path", include_paths), ("--limit", limit)) if v]
        given += ["--max-drop"] if max_drop is not None else []
        if given:
            raise click.UsageError(f"{', '.join(given)}: only with --harness lm-eval")
        _, path = build_until(recipe, overrides, "verify")
        click.echo((path / "accuracy.json").read_text() if as_json else (path / "accuracy.txt").read_text())
        return
    if not tasks:
        raise click.UsageError("--harness lm-eval needs --tasks T[,T..]")
    import json

    from trtpipe.app.harness import run_harness

    echo = (lambda s: click.echo(s, err=True)) if as_json else click.echo
    doc = run_harness(recipe, overrides, harness, tasks, include_paths, limit, max_drop, echo)
    if as_json:
        click.echo(json.dumps(doc, indent=1))
