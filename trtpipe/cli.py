"""The ``trtpipe`` command line: the group, and the registration of every verb of ``trtpipe.app.commands``."""

from __future__ import annotations

import click

from trtpipe import __version__
from trtpipe.app.commands import (
    batch,
    bench,
    build,
    calibrate,
    convert,
    deploy,
    doctor,
    engine,
    explain,
    gc,
    generate,
    infer,
    inspect,
    plan,
    predict,
    quantize,
    recipe,
    repo,
    report,
    schema,
    serve,
    status,
    stop,
    validate,
)
from trtpipe.app.commands import eval as eval_module
from trtpipe.app.options import CommandGroup


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtpipe")
def main() -> None:
    """Build and deploy LLMs on TensorRT-LLM and Triton from one YAML recipe."""


for command in (
    validate.validate,
    schema.schema,
    explain.explain,
    build.build,
    status.status,
    gc.gc,
    convert.convert,
    inspect.inspect,
    generate.generate,
    calibrate.calibrate,
    quantize.quantize,
    eval_module.eval_,
    plan.plan,
    predict.predict,
    engine.engine,
    doctor.doctor,
    repo.repo,
    recipe.recipe,
    serve.serve,
    stop.stop,
    infer.infer,
    bench.bench,
    report.report,
    batch.batch,
    deploy.deploy,
):
    main.add_command(command)
main.add_command(serve.serve, name="serve-openai")  # the OpenAI twin's older name: the same command

if __name__ == "__main__":  # pragma: no cover
    main()
