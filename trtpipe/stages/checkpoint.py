"""The ``checkpoint`` build stage: the HF model converted to a TRT-LLM checkpoint (unquantized, or, for a source
someone else already quantized, in the TRT-LLM layout of its format: :mod:`trtpipe.quant.imported`).

Its key covers the ``model`` and ``parallel`` sections and the fingerprints of the model's weight,
config and tokenizer files. The artifact is the checkpoint plus the tokenizer files and
``generation_config.json`` (the Triton repository stage reads them from here).
"""

from __future__ import annotations

from pathlib import Path

from trtpipe.checkpoint.convert import TOKENIZER_FILES, convert
from trtpipe.errors import CheckpointError
from trtpipe.models.dims import read_hf_config
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.recipe.schema import Recipe
from trtpipe.jsonfile import load_json

WEIGHT_PATTERNS = (
    "config.json",
    "hf_quant_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)


def model_dir(recipe: Recipe) -> Path:
    """The local directory of ``model.source`` (``hf://`` sources are fetched into the HF cache)."""
    source = recipe.model.source
    if source.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        return resolve_hf(source)
    path = recipe.resolve(source)
    if not path.is_dir():
        raise CheckpointError(f"model.source: '{source}' is not a directory ({path})")
    return path


def model_files(recipe: Recipe) -> list[Path]:
    """The files whose content decides the checkpoint (hf:// sources are keyed by their URI alone)."""
    if recipe.model.source.startswith("hf://"):
        return []
    path = recipe.resolve(recipe.model.source)
    if not path.is_dir():
        return []
    files = {p for pattern in WEIGHT_PATTERNS for p in path.glob(pattern)}
    files |= {path / n for n in TOKENIZER_FILES if (path / n).is_file()}
    return sorted(files)


def imported_format(recipe: Recipe):
    """The pre-quantized format of ``model.source`` (None: not quantized), from its config files only."""
    from trtpipe.quant.imported.detect import detect

    return detect(model_dir(recipe))


def run(ctx: StageContext) -> None:
    from trtpipe.quant.imported.trtllm import ImportedLinears

    recipe, par = ctx.recipe, ctx.recipe.parallel
    src = model_dir(recipe)
    info = read_hf_config(src)
    fmt = imported_format(recipe)
    importer = None
    if fmt is not None:
        ctx.log.info("pre-quantized source: %s", fmt.describe())
        ctx.info["imported"] = fmt.describe()
        allowed = tuple(recipe.model.allow_lossy_import)
        importer = lambda plan, reader: ImportedLinears(fmt, reader.keys(), str(src), allowed)  # noqa: E731
    ctx.log.info(
        "converting %s (%s) at tp=%d pp=%d dtype=%s", src, info.architecture, par.tp, par.pp, recipe.model.dtype
    )
    with ctx.progress("checkpoint: converting", total=info.num_layers + 2) as bar:
        convert(
            src,
            ctx.out_dir,
            tp=par.tp,
            pp=par.pp,
            dtype=recipe.model.dtype,
            moe_tp=par.moe_tp,
            moe_ep=par.moe_ep,
            allow_pickle=recipe.model.allow_pickle,
            overwrite=True,
            progress=lambda done, total: bar.advance(1),
            importer=importer,
        )
    config = load_json(ctx.out_dir / "config.json")
    ctx.info.update(
        architecture=info.architecture,
        dtype=config["dtype"],
        tp=par.tp,
        pp=par.pp,
        bytes=sum(p.stat().st_size for p in ctx.out_dir.glob("rank*.safetensors")),
    )


CHECKPOINT_STAGE = Stage(
    name="checkpoint",
    sections=("model", "parallel"),
    inputs=(),
    run=run,
    files=model_files,
    enabled=lambda recipe: not (recipe.target == "llmapi" and imported_format(recipe) is not None),
    description="HF model -> TensorRT-LLM checkpoint (sharded for tp x pp)",
)
