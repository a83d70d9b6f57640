"""The ``trtpipe`` command line: a thin click layer; each command parses, calls one library function, prints.

Commands are grouped by area in marked sections below. Imports of heavy modules (torch, tritonclient)
happen inside commands so ``trtpipe validate`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtpipe import __version__
from trtpipe.errors import TrtpipeError


def _fail(exc: TrtpipeError) -> None:
    click.echo(str(exc), err=True)
    sys.exit(exc.exit_code)


class _Group(click.Group):
    """Turns every TrtpipeError into its one-line message and exit code (no traceback)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtpipeError as exc:
            _fail(exc)
        except click.UsageError as exc:  # bad arguments: one line naming the command and the argument
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            message = " ".join(exc.format_message().split())
            click.echo(f"{where}: {message} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtpipe")
def main() -> None:
    """Build and deploy LLMs on TensorRT-LLM and Triton from one YAML recipe."""


OVERRIDES = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe key, e.g. --set parallel.tp=2."
)


# --- recipe commands -------------------------------------------------------------------------------


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(path_type=Path))
@OVERRIDES
def validate(recipes: tuple[Path, ...], overrides: tuple[str, ...]) -> None:
    """Check recipes (schema and cross-field rules) without loading weights. Exit 2 on any error."""
    from trtpipe.errors import RecipeError
    from trtpipe.validation import load_recipe

    failed = False
    for path in recipes:
        try:
            load_recipe(path, overrides)
            click.echo(f"{path}: ok")
        except RecipeError as exc:
            click.echo(str(exc), err=True)
            failed = True
    if failed:
        sys.exit(RecipeError.exit_code)


@main.command()
@click.option("--markdown", is_flag=True, help="The recipe reference as Markdown tables instead (recipes/README.md).")
def schema(markdown: bool) -> None:
    """Print the recipe JSON Schema (for editor completion)."""
    from trtpipe.recipe.describe import recipe_json_schema, reference_markdown

    click.echo(reference_markdown() if markdown else json.dumps(recipe_json_schema(), indent=2), nl=not markdown)


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Plain JSON instead of annotated YAML.")
def explain(recipe: Path, overrides: tuple[str, ...], as_json: bool) -> None:
    """Print the fully resolved recipe, every default shown and marked."""
    from trtpipe.recipe.describe import explain as explain_recipe
    from trtpipe.validation import load_recipe

    click.echo(explain_recipe(load_recipe(recipe, overrides), as_json=as_json), nl=False)


# --- build pipeline commands -----------------------------------------------------------------------


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--force", multiple=True, metavar="STAGE", help="Rerun STAGE even if cached (repeatable; 'all').")
@click.option("--from", "from_stage", metavar="STAGE", help="Rerun STAGE and all later ones; earlier must be cached.")
@click.option("--until", metavar="STAGE", help="Stop after STAGE.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the manifest summary), nothing else.")
@click.pass_context
def build(ctx, recipe: Path, overrides, force, from_stage, until, as_json: bool) -> None:
    """Run the build stages that exist, reusing cached artifacts; write <work_dir>/manifest.json."""
    from trtpipe.errors import StageError
    from trtpipe.pipeline.runner import run_build
    from trtpipe.processes import sigterm_as_interrupt
    from trtpipe.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    stages = (ctx.obj or {}).get("stages")  # a program embedding the CLI (the tests) may pass its own stages
    sigterm_as_interrupt()  # SIGTERM cleans up like Ctrl-C: temporary artifacts removed, manifest "interrupted"
    try:
        result = run_build(loaded, stages, force, from_stage, until, quiet=as_json, overrides=overrides)
    except StageError as exc:
        if as_json and getattr(exc, "result", None) is not None:
            click.echo(json.dumps(exc.result.summary(), indent=2))
        raise
    if as_json:
        click.echo(json.dumps(result.summary(), indent=2))
        return
    click.echo(f"manifest: {result.manifest_path}")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--verify", is_flag=True, help="Re-hash every file listed in the last manifest (exit 1 on mismatch).")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of a table.")
@click.pass_context
def status(ctx, recipe: Path, overrides, verify: bool, as_json: bool) -> None:
    """Show each stage's key, whether its artifact is cached, and the last build."""
    from trtpipe.pipeline.runner import build_status, render_status
    from trtpipe.validation import load_recipe

    report = build_status(load_recipe(recipe, overrides), (ctx.obj or {}).get("stages"), verify=verify)
    click.echo(json.dumps(report, indent=2) if as_json else render_status(report))
    if verify and report.get("verify"):
        sys.exit(1)

@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--delete", is_flag=True, help="Delete the unused artifacts (default: only list them).")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of lines.")
@click.pass_context
def gc(ctx, recipe: Path, overrides, delete: bool, as_json: bool) -> None:
    """List (or --delete) artifacts that neither the recipe's current keys nor the last build use."""
    from trtpipe.pipeline.runner import collect_garbage, render_garbage
    from trtpipe.validation import load_recipe

    report = collect_garbage(load_recipe(recipe, overrides), (ctx.obj or {}).get("stages"), delete=delete)
    click.echo(json.dumps(report, indent=2) if as_json else render_garbage(report, delete))


# --- checkpoint commands (convert, inspect, generate) ----------------------------------------------


@main.command()
@click.argument("hf_dir", type=click.Path(file_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--tp", default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float16", "bfloat16", "float32"]))
@click.option("--moe-ep", default=-1, show_default=True, help="MoE expert-parallel size (-1: derived).")
@click.option("--moe-tp", default=-1, show_default=True, help="MoE tensor-parallel size (-1: derived).")
@click.option("--parallel-embedding", is_flag=True, help="Shard the embedding table over tp (vocab dim).")
@click.option("--allow-pickle", is_flag=True, help="Accept .bin checkpoints (loaded with weights_only=True).")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists.")
def convert(hf_dir, out_dir, tp, pp, dtype, moe_ep, moe_tp, parallel_embedding, allow_pickle, overwrite) -> None:
    """Convert a Hugging Face model to a TensorRT-LLM checkpoint (rank files for tp x pp)."""
    from trtpipe.checkpoint.convert import convert as run_convert

    run_convert(hf_dir, out_dir, tp=tp, pp=pp, dtype=dtype, moe_tp=moe_tp, moe_ep=moe_ep, allow_pickle=allow_pickle,
                use_parallel_embedding=parallel_embedding, overwrite=overwrite)
    click.echo(str(out_dir))


@main.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="JSON output.")
def inspect(path: Path, as_json: bool) -> None:
    """Summarize an HF model directory or a TensorRT-LLM checkpoint (dims, quantization, per-rank tensors)."""
    from trtpipe.checkpoint.inspect import format_summary, inspect_path

    summary = inspect_path(path)
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))


@main.command()
@click.argument("ckpt_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--top-k", default=0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
def generate(ckpt_dir, prompt, max_tokens, tokenizer_dir, temperature, top_k, top_p, seed) -> None:
    """Generate text with the CPU reference runtime from a TensorRT-LLM checkpoint (streams to stdout)."""
    from trtpipe.runtime.text import stream_text

    stream_text(ckpt_dir, prompt, max_tokens, tokenizer_dir, temperature, top_k, top_p, seed,
                write=lambda text: click.echo(text, nl=False))

# --- quantization commands (calibrate, quantize, eval) ---------------------------------------------


def _build_until(recipe: Path, overrides, stage: str, force: tuple[str, ...] = ()):
    """Run the build up to ``stage`` (earlier stages reused when cached); return its artifact directory."""
    from trtpipe.pipeline.runner import run_build
    from trtpipe.validation import load_recipe

    result = run_build(load_recipe(recipe, overrides), None, force, None, stage, overrides=overrides)
    return result, result.artifact(stage)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--force", is_flag=True, help="Recompute even when cached statistics exist.")
def calibrate(recipe: Path, overrides, force: bool) -> None:
    """Run calibration alone; print where its statistics are (reused by every algorithm that can)."""
    _, path = _build_until(recipe, overrides, "calibrate", ("calibrate",) if force else ())
    click.echo(f"calibration statistics: {path}")


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
def quantize(recipe: Path, overrides) -> None:
    """Write the quantized TensorRT-LLM checkpoint (calibrating first when needed); print its path."""
    _, path = _build_until(recipe, overrides, "quantize")
    click.echo(f"quantized checkpoint: {path}")


@main.command(name="eval")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of the table.")
def eval_(recipe: Path, overrides, as_json: bool) -> None:
    """Accuracy report of the quantized model against the unquantized one; fails when the recipe's gate does."""
    _, path = _build_until(recipe, overrides, "verify")
    click.echo((path / "accuracy.json").read_text() if as_json else (path / "accuracy.txt").read_text())

# --- engine commands (plan, engine, doctor) --------------------------------------------------------

_MODEL_CONFIG = click.option("--model-config", type=click.Path(dir_okay=False, path_type=Path),
                             help="A Hugging Face config.json for a model not on this disk (e.g. recipes/configs/...).")
_CHECKPOINT = click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path),
                           help="A built TensorRT-LLM checkpoint: its config.json and real weight bytes are used.")


@main.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@_MODEL_CONFIG
@_CHECKPOINT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--list-gpus", is_flag=True, help="Print the GPU catalog and exit.")
@click.option("--slo", help="Capacity answer: latency targets METRIC[_pQ]:VALUE[ms|s|us] (ttft, itl, e2e; no _pQ: "
              "every request), e.g. ttft_p99=500ms,itl_p99=50ms (with --rate).")
@click.option("--rate", type=float, default=0.0, help="Poisson request rate (req/s) the SLO must hold at.")
@click.option("--isl", type=int, default=1024, show_default=True, help="Input tokens per request (with --slo).")
@click.option("--osl", type=int, default=256, show_default=True, help="Output tokens per request (with --slo).")
@click.option("--gpus", help="Comma-separated catalog keys to consider (with --slo; default: every modelled GPU).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Write throughput vs latency PNG.")
@click.option("--precisions", help="With --slo: quantization.algo variants to compare, e.g. fp8,int4_awq,none.")
def plan(recipe, overrides, gpu, model_config, checkpoint, as_json, list_gpus, slo, rate, isl, osl, gpus,
         plot, precisions) -> None:
    """Memory plan per GPU: weights, activations, KV pool and concurrent sequences; exit 3 if it does not fit.

    With --slo and --rate: the cheapest layouts (GPU type and count, tp) predicted to meet the SLO."""
    from trtpipe.engine import planning

    if slo:
        if recipe is None or rate <= 0:
            raise click.UsageError("--slo needs RECIPE and --rate")
        from trtpipe.perf import predict_command

        predict_command.plan_command(recipe, overrides, model_config, slo, rate, isl, osl, gpus, plot, as_json,
                                 precisions)
        return
    if list_gpus:
        click.echo(planning.gpu_table())
        return
    if recipe is None:
        raise click.UsageError("RECIPE is required (or --list-gpus)")
    r = planning.resolve(recipe, overrides, gpu=gpu, model_config=model_config, checkpoint=checkpoint)
    click.echo(json.dumps(planning.plan_json(r), indent=2) if as_json else planning.render_plan(r))
    if not r.plan.fits:
        sys.exit(3)


@main.command()
@click.argument("recipe", required=False, type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@_MODEL_CONFIG
@click.option("--isl", type=int, default=1024, show_default=True, help="Input tokens per request.")
@click.option("--osl", type=int, default=256, show_default=True, help="Output tokens per request.")
@click.option("--concurrency", type=int, default=16, show_default=True, help="Closed-loop clients.")
@click.option("--rate", type=float, default=0.0, help="Poisson request rate (req/s) instead of --concurrency.")
@click.option("--num-requests", type=int, default=0, help="Requests to simulate (default: 4 x concurrency).")
@click.option("--published", type=click.Path(dir_okay=False, path_type=Path),
              help="A published-numbers CSV: quote the rows nearest to the prediction.")
@click.option("--scenarios", type=click.Path(dir_okay=False, path_type=Path),
              help="Predict every row of a published-format CSV (first 15 columns) instead of a recipe.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="With --scenarios: the output CSV.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def predict(recipe, overrides, gpu, model_config, isl, osl, concurrency, rate, num_requests, published, scenarios,
            out, as_json) -> None:
    """Predicted serving performance (tok/s, TTFT/ITL percentiles, bounds) from the fitted cost model."""
    from trtpipe.perf import predict_command

    if scenarios:
        if out is None:
            raise click.UsageError("--scenarios needs --out")
        predict_command.scenarios_command(scenarios, out)
        return
    if recipe is None:
        raise click.UsageError("RECIPE is required (or --scenarios FILE --out OUT)")
    predict_command.predict_command(recipe, overrides, gpu, model_config, isl, osl, concurrency, rate, num_requests,
                                published, as_json)


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--gpu", help="Target GPU from the catalog (default: the recipe's engine.gpu).")
@_MODEL_CONFIG
@_CHECKPOINT
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Build into this (empty) directory: TensorRT engines, or the CPU twin without TensorRT-LLM.")
def engine(recipe, overrides, gpu, model_config, checkpoint, out) -> None:
    """Print the trtllm-build command and build_config JSON; with --checkpoint and --out, build."""
    import logging

    from trtpipe.engine import planning

    r = planning.resolve(recipe, overrides, gpu=gpu, model_config=model_config, checkpoint=checkpoint)
    if out is None:
        click.echo(planning.render_build(r))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = planning.build_engine(r, out, logging.getLogger("trtpipe.engine"))
    click.echo(f"{out}: {info['engine']} engine")


@main.command()
@click.argument("engine_dir", required=False, type=click.Path(file_okay=False, exists=True, path_type=Path))
def doctor(engine_dir) -> None:
    """Check python, torch, GPU, driver, CUDA, TensorRT, TensorRT-LLM, MPI and tritonserver (against ENGINE_DIR)."""
    from trtpipe.engine import doctor as doc

    checks = doc.diagnose(engine_dir)
    click.echo(doc.render(checks, engine_dir))
    if doc.failed(checks):
        sys.exit(1)


# --- triton commands (repo, serve, stop, infer, bench, report) ---------------------------------------------


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--engine", "engine_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Use this engine dir (TensorRT or CPU twin) instead of building the recipe.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Tokenizer + generation_config.json dir (with --engine; default <engine>/checkpoint).")
@click.option("--out", type=click.Path(path_type=Path), help="Output dir (default: triton.repo_dir, else the build artifact).")
def repo(recipe: Path, overrides, engine_dir, tokenizer_dir, out) -> None:
    """Write the Triton model repository: build the recipe up to the repo stage, or from --engine."""
    from trtpipe.triton.launch import write_repository

    click.echo(write_repository(recipe, overrides, engine_dir, tokenizer_dir, out))


@main.command()
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@OVERRIDES
@click.option("--bind", default=None, help="Address of all endpoints (default: recipe triton.bind or llmapi.host, "
              "else 127.0.0.1).")
@click.option("--http-port", type=int, help="HTTP port (llmapi target: the OpenAI API's, default llmapi.port).")
@click.option("--grpc-port", type=int)
@click.option("--metrics-port", type=int)
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for readiness.")
@click.option("--detach", is_flag=True, help="Return once ready; stop it later with trtpipe stop.")
@click.option("--dry-run", is_flag=True, help="Print the launch command (mpirun leader mode for TensorRT engines).")
@click.option("--tritonserver", default="/opt/tritonserver/bin/tritonserver", show_default=True,
              help="tritonserver binary of the TensorRT-LLM container (TensorRT engines).")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="MPI hostfile (host:slots per line) for a multi-node leader-mode launch.")
@click.option("--single-process", is_flag=True,
              help="CPU twin of a tp/pp>1 repository: run every rank's shard in one tritonserver (no MPI).")
@click.option("--served-model-name", default=None, help="llmapi target: the model name clients send "
              "(default: recipe llmapi.served_model_name, else its name).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="llmapi target: Jinja chat template file, for tokenizers without one.")
@click.option("--dynamo", is_flag=True, help="llmapi target: NVIDIA Dynamo's frontend and router in front of "
              "--replicas twin workers (Dynamo in its own venv: scripts/install_dynamo.sh).")
@click.option("--replicas", default=1, show_default=True, type=int, help="--dynamo: how many workers.")
@click.option("--router", type=click.Choice(["kv", "round-robin"]), default="kv", show_default=True,
              help="--dynamo: the frontend's router mode (kv: to the worker holding the longest cached prefix).")
def serve(target: Path, overrides, bind, http_port, grpc_port, metrics_port, timeout, detach, dry_run, tritonserver,
          hostfile, single_process, served_model_name, chat_template, dynamo, replicas, router) -> None:
    """Serve any target; Ctrl-C stops it cleanly. A Triton model repository or an engine recipe (built first if
    needed) runs on tritonserver; a target: llmapi recipe (or an HF checkpoint dir) on the OpenAI-compatible
    twin of trtllm-serve (what serve-openai runs)."""
    from trtpipe.serving.openai_launch import is_openai_target, serve_openai
    from trtpipe.triton.launch import serve_repository

    if is_openai_target(target, overrides):
        triton_only = {"--grpc-port": grpc_port, "--metrics-port": metrics_port, "--dry-run": dry_run,
                       "--hostfile": hostfile, "--single-process": single_process}
        if any(triton_only.values()):
            raise click.UsageError(f"{', '.join(k for k, v in triton_only.items() if v)}: for Triton targets; {target} "
                                   "is served by the OpenAI twin (options: --bind, --http-port, --detach, --timeout)")
        if dynamo:
            from trtpipe.serving.dynamo_launch import serve_dynamo

            serve_dynamo(target, overrides, bind, http_port, served_model_name, replicas, router, chat_template, detach,
                         timeout, click.echo)
            return
        serve_openai(target, overrides, bind, http_port, served_model_name, chat_template, detach, timeout, click.echo)
        return
    if dynamo:
        raise click.UsageError(f"--dynamo: for target: llmapi recipes (Dynamo's TensorRT-LLM workers run the PyTorch "
                               f"backend); {target} is a Triton target")
    sys.exit(serve_repository(target, overrides, bind, http_port, grpc_port, metrics_port, timeout, detach, dry_run,
                              tritonserver, hostfile, single_process, click.echo))


@main.command()
@click.argument("target", required=False, type=click.Path(exists=True, path_type=Path))
@OVERRIDES
def stop(target, overrides) -> None:
    """Stop servers started with serve --detach (TARGET: repository, recipe or model dir; default: the only one)."""
    from trtpipe.triton.launch import stop_servers

    stop_servers(target, overrides, click.echo)


GEN_OPTIONS = [
    click.option("--url", help="HOST:PORT (gRPC, or HTTP with --protocol http); default: the detached server."),
    click.option("--server", type=click.Path(exists=True, path_type=Path),
                 help="Use the detached server of this repository or recipe (instead of --url)."),
    OVERRIDES,
    click.option("--protocol", type=click.Choice(["grpc", "http"]), default="grpc", show_default=True),
    click.option("--model", help="Front model (default: tensorrt_llm_bls for streams if present, else the ensemble)."),
    click.option("--max-tokens", default=64, show_default=True, type=int),
    click.option("--temperature", type=float),
    click.option("--top-k", type=int),
    click.option("--top-p", type=float),
    click.option("--seed", type=int),
]


def _gen_options(fn):
    for opt in reversed(GEN_OPTIONS):
        fn = opt(fn)
    return fn


@main.command()
@click.argument("prompt")
@_gen_options
@click.option("--stream", is_flag=True, help="Print the answer as it is generated (gRPC, decoupled repository).")
def infer(prompt, url, server, overrides, protocol, model, max_tokens, temperature, top_k, top_p, seed, stream) -> None:
    """Ask the served model PROMPT and print the answer."""
    from trtpipe.triton.client import Client, GenerateOptions
    from trtpipe.triton.launch import client_url

    opts = GenerateOptions(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with Client(client_url(url, protocol, server, overrides), protocol, model) as client:
        if stream:
            for piece in client.stream(prompt, opts):
                click.echo(piece, nl=False)
            click.echo()
        else:
            click.echo(client.generate(prompt, opts))


class _DefaultGroup(_Group):
    """A group whose first argument may be a subcommand or, if not, the arguments of ``default_cmd``."""

    default_cmd = "run"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = [self.default_cmd, *args]
        elif not args:
            args = [self.default_cmd]
        return super().parse_args(ctx, args)


@main.group(cls=_DefaultGroup)
def bench() -> None:
    """Benchmark a served model with NVIDIA AIPerf (default: bench run); compare results; cold start."""


def _int_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _float_list(ctx, param, value):
    if value is None:
        return None
    try:
        return [float(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


@bench.command(name="run")
@click.argument("target", required=False, type=click.Path(exists=True, path_type=Path))
@OVERRIDES
@click.option("--server", "server", type=click.Path(exists=True, path_type=Path), help="Same as TARGET.")
@click.option("--url", help="HTTP HOST:PORT of a running server (instead of TARGET; needs --tokenizer).")
@click.option("--model", help="Front model (default: tensorrt_llm_bls when it streams, else the ensemble).")
@click.option("--tokenizer", help="Tokenizer directory (default: the repository's).")
@click.option("--metrics-url", help="tritonserver metrics endpoint (default: the served repository's metrics port).")
@click.option("--concurrency", "-c", callback=_int_list, help="Closed loop: requests in flight; a list sweeps (1,2,4,8).")
@click.option("--request-rate", callback=_float_list, help="Open loop: requests/s; a list sweeps.")
@click.option("--arrival", type=click.Choice(["poisson", "constant"]), default="poisson", show_default=True,
              help="Arrival process of --request-rate.")
@click.option("--requests", "-n", "num_requests", type=click.IntRange(1, 1_000_000), help="Requests per point (default 32).")
@click.option("--duration", type=click.FloatRange(0.1), help="Seconds per point instead of a request count.")
@click.option("--warmup", type=click.IntRange(0, 100_000), default=2, show_default=True, help="Warm-up requests per point.")
@click.option("--isl", type=click.IntRange(1), help="Prompt tokens (default: min(128, max_input_len)).")
@click.option("--isl-stddev", type=click.IntRange(0), default=0, show_default=True)
@click.option("--osl", type=click.IntRange(1), help="Output tokens (default: min(64, max_seq_len - ISL)).")
@click.option("--no-fixed-osl", is_flag=True, help="Let the model stop at EOS (default: end_id=-1 / min_tokens force OSL).")
@click.option("--slo", help="Goodput SLOs, per-request bounds METRIC:VALUE[ms|s|us] (ttft, ttst, itl, tpot, e2e), "
              "e.g. ttft:200ms,itl:50ms.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Result directory (default: <work_dir>/bench/<time>-<label>, or ./bench-results/...).")
@click.option("--json", "as_json", is_flag=True, help="Print the result JSON (one point) or the sweep index.")
def bench_run(target, overrides, server, url, model, tokenizer, metrics_url, concurrency, request_rate, arrival,
              num_requests, duration, warmup, isl, isl_stddev, osl, no_fixed_osl, slo, seed, out, as_json) -> None:
    """Benchmark TARGET (recipe or repository) with AIPerf; one result.json per load point, plots for sweeps."""
    from trtpipe.bench.command import bench_command

    bench_command(target or server, overrides, url, model, tokenizer, metrics_url, concurrency, request_rate, arrival,
                  num_requests, duration, warmup, isl, isl_stddev, osl, not no_fixed_osl, slo, seed, out, as_json,
                  echo=click.echo)


@bench.command(name="compare")
@click.argument("a")
@click.argument("b")
@click.option("--fail-if", "fail_if", multiple=True, metavar="METRIC.STAT>+N%",
              help="Exit 1 when B crosses this (and its 95% CI excludes no change), e.g. 'ttft.p99>+10%'.")
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
@click.option("--json", "as_json", is_flag=True)
def bench_compare(a, b, fail_if, seed, as_json) -> None:
    """Compare bench results A and B (result.json or its directory; several runs of one side: A1,A2,A3):
    deltas, bootstrap CIs, gates."""
    from trtpipe.bench.compare import compare_paths, render

    result, warn = compare_paths(a, b, fail_if, seed)
    click.echo(json.dumps(result, indent=1) if as_json else render(result))
    if warn:
        click.echo(f"warning: {warn}", err=True)
    if result["failed"]:
        sys.exit(1)


@bench.command(name="show")
@click.argument("result", type=click.Path(exists=True, path_type=Path))
@click.option("--aiperf", "side_by_side", is_flag=True, help="Also print trtpipe's numbers next to AIPerf's export.")
def bench_show(result, side_by_side) -> None:
    """Print a bench result (result.json or its directory)."""
    from trtpipe.bench.run import agreement_table, load_result, render

    doc = load_result(result)
    click.echo(render(doc))
    if side_by_side:
        click.echo(agreement_table(doc))


@bench.command(name="plot")
@click.argument("sweep_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def bench_plot(sweep_dir) -> None:
    """Redraw a sweep's plots and sweep.csv from its result files."""
    from trtpipe.bench.sweep import load_sweep, write_sweep

    index = write_sweep(sweep_dir, load_sweep(sweep_dir))
    click.echo("plots: " + ", ".join(index["plots"]))


@bench.command(name="cold")
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--warm-requests", type=click.IntRange(1, 1000), default=5, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=16, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def bench_cold(recipe, overrides, warm_requests, max_tokens, as_json) -> None:
    """Start a fresh server for RECIPE; time its load, its first (cold) request and the warm ones after it."""
    from trtpipe.bench.coldstart import measure_cold, render

    result = measure_cold(recipe, overrides, warm_requests=warm_requests, max_tokens=max_tokens)
    click.echo(json.dumps(result, indent=1) if as_json else render(result))


@main.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("report"), show_default=True,
              help="Where report.json, report.md and report.png go.")
@click.option("--json", "as_json", is_flag=True)
def report(recipes, overrides, out, as_json) -> None:
    """Which build to deploy: accuracy (verify), memory (plan) and bench numbers of several recipes, side by side."""
    from trtpipe.bench.deploy_report import build_report

    doc = build_report(list(recipes), overrides, out)
    click.echo(json.dumps(doc, indent=1) if as_json else doc["text"])


def _priority(ctx, param, value):
    if value is None or str(value).lower() == "none":
        return None
    try:
        p = float(value)
    except ValueError:
        raise click.BadParameter(f"expected a number in [0, 1] or 'none', got {value!r}") from None
    if not 0.0 <= p <= 1.0:
        raise click.BadParameter(f"expected a number in [0, 1] or 'none', got {value!r}")
    return p


@main.command()
@click.argument("target")
@OVERRIDES
@click.option("--input", "-i", "input_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="OpenAI Batch input JSONL: one {custom_id, method, url, body} per line.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Results JSONL (appended; rerunning with it resumes the job).")
@click.option("--errors", type=click.Path(dir_okay=False, path_type=Path),
              help="Failed requests JSONL (default: OUTPUT's name with .errors before the suffix).")
@click.option("--state", type=click.Path(dir_okay=False, path_type=Path), help="State file (default: OUTPUT.state.json).")
@click.option("--concurrency", "-c", type=click.IntRange(1, 4096), default=8, show_default=True,
              help="Most requests in flight (less while the server reports pressure).")
@click.option("--priority", callback=_priority, default="0.0", show_default=True,
              help="OpenAI 'priority' sent with each request, in [0, 1], higher first (trtllm-serve's default is "
                   "0.5); 'none': not sent.")
@click.option("--max-retries", type=click.IntRange(0, 100), default=5, show_default=True,
              help="Tries after the first for 5xx answers and lost connections (429/503 are always retried).")
@click.option("--request-timeout", type=click.FloatRange(1), default=600.0, show_default=True, help="Seconds per request.")
@click.option("--server-wait", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds the server may be unreachable before the job stops (resumable).")
@click.option("--checkpoint-interval", type=click.FloatRange(0.1, 30), default=10.0, show_default=True,
              help="Seconds between state-file checkpoints.")
@click.option("--metrics-interval", type=click.FloatRange(0), default=2.0, show_default=True,
              help="Seconds between reads of the server's Prometheus metrics (0: only 429/503 slow the job).")
@click.option("--retry-errors", is_flag=True,
              help="Send the errors file's requests again; the file is first renamed to ERRORS.retried-N.jsonl.")
@click.option("--no-progress", is_flag=True, help="No progress bar (the summary is still printed).")
def batch(target, overrides, input_path, output, errors, state, concurrency, priority, max_retries, request_timeout,
          server_wait, checkpoint_interval, metrics_interval, retry_errors, no_progress) -> None:
    """Run an OpenAI Batch file against TARGET: a served URL (http://HOST:PORT), or a target: llmapi recipe (or
    HF directory) served for the job and stopped after it. Killed at any moment, the same command resumes:
    each custom_id is written exactly once. Exit 0 all succeeded, 3 some failed (see the errors file), 1 the
    server stayed unreachable, 130 interrupted (both resumable), 2 bad input."""
    from trtpipe.batch.client import ClientOptions
    from trtpipe.batch.command import BatchJob, run_job
    from trtpipe.processes import sigterm_as_interrupt

    opts = ClientOptions(concurrency=concurrency, priority=priority, max_retries=max_retries,
                         request_timeout_s=request_timeout, server_wait_s=server_wait,
                         metrics_interval_s=metrics_interval, checkpoint_interval_s=checkpoint_interval)
    job = BatchJob(target, input_path, output, errors, state, overrides, opts, progress=not no_progress,
                   retry_errors=retry_errors)
    sigterm_as_interrupt()
    sys.exit(run_job(job, click.echo, lambda line: click.echo(line, err=True)))


@main.command(name="serve-openai")
@click.argument("target", type=click.Path(exists=True, path_type=Path))
@OVERRIDES
@click.option("--host", default=None, help="Address (default: recipe llmapi.host, else 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (default: recipe llmapi.port, else 8000).")
@click.option("--served-model-name", default=None, help="Model name clients send (default: recipe name / dir name).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Jinja chat template file, for tokenizers without one (as trtllm-serve --chat_template).")
def serve_openai(target: Path, overrides, host, port, served_model_name, chat_template) -> None:
    """Serve an llmapi recipe's export (built first if needed) or an HF checkpoint directory with the
    OpenAI-compatible twin of trtllm-serve, in the foreground (trtpipe serve does the same for these targets)."""
    from trtpipe.serving.openai_launch import is_openai_target, serve_openai as run

    if target.is_file() and not is_openai_target(target, overrides):
        raise click.UsageError(f"{target}: not a target: llmapi recipe; serve-openai serves those "
                               "(use trtpipe serve for the Triton repository)")
    run(target, overrides, host, port, served_model_name, chat_template, False, 0.0, click.echo)


# ---- deploy: Kubernetes manifests and monitoring -------------------------------------------------------------
@main.group()
def deploy() -> None:
    """Deploy beyond one host: Kubernetes manifests (k8s) and Prometheus/Grafana monitoring (monitoring)."""


@deploy.command(name="monitoring")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option("--target", "targets", multiple=True, help="HOST:PORT to scrape (repeatable; default: the recipe's).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_monitoring(recipe: Path, overrides, out: Path, targets, overwrite: bool) -> None:
    """Prometheus scrape config, rule file (recording rules, SLO alerts) and Grafana dashboard for RECIPE."""
    from trtpipe.deploy.monitoring import write_monitoring
    from trtpipe.validation import load_recipe

    for path in write_monitoring(load_recipe(recipe, overrides), out, targets or None, overwrite=overwrite):
        click.echo(path)


@deploy.command(name="k8s")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option("--autoscaler", type=click.Choice(["hpa", "keda"]), default=None,
              help="HPA + prometheus-adapter rules, or a KEDA ScaledObject (default: the recipe's deploy.autoscaler).")
@click.option("--cold-start", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A `trtpipe bench cold --json` result: its measured ready time also bounds the startup probe.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_k8s(recipe: Path, overrides, out: Path, autoscaler, cold_start, overwrite: bool) -> None:
    """Kubernetes manifests + kustomization for RECIPE (Deployment, or LeaderWorkerSet across nodes)."""
    from trtpipe.deploy.k8s import write_k8s
    from trtpipe.deploy.sources import measured_ready_s, planned_weight_bytes
    from trtpipe.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    weights = planned_weight_bytes(recipe, overrides)
    for path in write_k8s(loaded, out, weights, measured_ready_s(cold_start), autoscaler, overwrite):
        click.echo(path)


@deploy.command(name="dynamo")
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@OVERRIDES
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Output directory.")
@click.option("--disagg", is_flag=True, help="Separate prefill and decode workers (KV handed over between them).")
@click.option("--router", type=click.Choice(["kv", "round-robin"]), default="kv", show_default=True,
              help="The frontend's --router-mode.")
@click.option("--cold-start", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A `trtpipe bench cold --json` result: its measured ready time also bounds the startup probe.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
def deploy_dynamo(recipe: Path, overrides, out: Path, disagg: bool, router: str, cold_start, overwrite: bool) -> None:
    """NVIDIA Dynamo DynamoGraphDeployment + engine ConfigMaps for an llmapi RECIPE, and launch.sh for one host."""
    from trtpipe.deploy.dynamo import write_dynamo
    from trtpipe.deploy.sources import measured_ready_s, planned_weight_bytes
    from trtpipe.validation import load_recipe

    loaded = load_recipe(recipe, overrides)
    if loaded.target != "llmapi":
        raise click.UsageError(f"{recipe}: target: {loaded.target}; deploy dynamo serves target: llmapi recipes "
                               "(use deploy k8s for the Triton repository)")
    weights = planned_weight_bytes(recipe, overrides)
    for path in write_dynamo(loaded, out, weights, measured_ready_s(cold_start), disagg, router, overwrite):
        click.echo(path)


if __name__ == "__main__":  # pragma: no cover
    main()
