"""What several commands share: the click group that turns a ``TrtpipeError`` into its one line and exit code,
the common options, option parsers, and ``build_until`` (the build up to one stage)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trtpipe.errors import TrtpipeError


def fail(exc: TrtpipeError) -> None:
    click.echo(str(exc), err=True)
    sys.exit(exc.exit_code)


class CommandGroup(click.Group):
    """Turns every TrtpipeError into its one-line message and exit code (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtpipeError as exc:
            fail(exc)
        except click.UsageError as exc:  # bad arguments: one line naming the command and the argument
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            message = " ".join(exc.format_message().split())
            click.echo(f"{where}: {message} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


class DefaultGroup(CommandGroup):
    """A group whose first argument may be a subcommand or, if not, the arguments of ``default_cmd``."""

    default_cmd = "run"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = [self.default_cmd, *args]
        elif not args:
            args = [self.default_cmd]
        return super().parse_args(ctx, args)


OVERRIDES = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key, e.g. --set parallel.tp=2."
)
MODEL_CONFIG = click.option(
    "--model-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A Hugging Face config.json for a model not on this disk (e.g. recipes/configs/...).",
)
CHECKPOINT = click.option(
    "--checkpoint",
    type=click.Path(file_okay=False, path_type=Path),
    help="A built TensorRT-LLM checkpoint: its config.json and real weight bytes are used.",
)

GEN_OPTIONS = [
    click.option("--url", help="HOST:PORT (gRPC, or HTTP with --protocol http); default: the detached server."),
    click.option(
        "--server",
        type=click.Path(exists=True, path_type=Path),
        help="Use the detached server of this repository or recipe (instead of --url).",
    ),
    OVERRIDES,
    click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True),
    click.option("--model", help="Front model (default: tensorrt_llm_bls for streams if present, else the ensemble)."),
    click.option("--max-tokens", default=64, show_default=True, type=int),
    click.option("--temperature", type=float),
    click.option("--top-k", type=int),
    click.option("--top-p", type=float),
    click.option("--seed", type=int),
]


def gen_options(fn):
    """The generation options of ``infer`` (and any other client command)."""
    for opt in reversed(GEN_OPTIONS):
        fn = opt(fn)
    return fn


def int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def float_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [float(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


def priority_value(ctx, param, value):
    if value is None or str(value).lower() == "none":
        return None
    try:
        p = float(value)
    except ValueError:
        raise click.BadParameter(f"expected a number in [0, 1] or 'none', got {value!r}") from None
    if not 0.0 <= p <= 1.0:
        raise click.BadParameter(f"expected a number in [0, 1] or 'none', got {value!r}")
    return p


def build_until(recipe: Path, overrides, stage: str, force: tuple[str, ...] = ()):
    """Run the build up to ``stage`` (earlier stages reused when cached); return its artifact directory."""
    from trtpipe.pipeline.runner import run_build
    from trtpipe.app.stage_table import STAGES
    from trtpipe.app.validation import load_recipe

    result = run_build(load_recipe(recipe, overrides), STAGES, force, None, stage, overrides=overrides)
    return result, result.artifact(stage)
