"""The ``export`` build stage (``target: llmapi``): the unified HF checkpoint for TensorRT-LLM's PyTorch backend,
written from the ``checkpoint`` artifact and the ``calibrate`` statistics (the same numbers the engine path uses;
nothing is recalibrated), plus a compressed-tensors checkpoint for vLLM / SGLang when the recipe asks for one.
A pre-quantized ``model.source`` is passed through or re-laid out instead (:mod:`trtpipe.export.imported`).

Artifact: ``hf/`` (config.json with the inline quantization_config, hf_quant_config.json, model*.safetensors,
tokenizer and generation files) and, optionally, ``compressed-tensors/``.
"""

from __future__ import annotations

from pathlib import Path

from trtpipe.stages.checkpoint import imported_format, model_dir, model_files
from trtpipe.export.unified import export_unified
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.recipe.schema import Recipe

HF_DIR = "hf"
CT_DIR = "compressed-tensors"


def is_llmapi(recipe: Recipe) -> bool:
    return recipe.target == "llmapi"


def run(ctx: StageContext) -> None:
    r, q = ctx.recipe, ctx.recipe.quantization
    common = dict(
        algo=q.algo, kv_cache=q.kv_cache, group_size=q.group_size, alpha=q.smoothquant_alpha, exclude=list(q.exclude)
    )
    hf = ctx.out_dir / HF_DIR
    hf.mkdir()
    fmt = imported_format(r)
    if fmt is not None:  # someone else quantized it: passed through or re-laid out, never quantized again
        from trtpipe.export.imported import write_llmapi

        ctx.log.info("pre-quantized source: %s (%s)", fmt.describe(), fmt.llmapi.kind)
        hq = write_llmapi(fmt, model_dir(r), hf)
        ctx.info.update(
            imported=fmt.describe(),
            action=fmt.llmapi.kind,
            quantization=hq.get("quantization"),
            bytes=sum(p.stat().st_size for p in hf.glob("*.safetensors")),
        )
        return
    with ctx.progress("export: unified HF checkpoint", total=None) as bar:
        hq = export_unified(
            ctx.inputs["checkpoint"],
            model_dir(r),
            ctx.inputs.get("calibrate"),
            hf,
            max_shard_bytes=r.llmapi.max_shard_bytes,
            progress=lambda s: bar.advance(1),
            **common,
        )
    ctx.info.update(quantization=hq["quantization"], bytes=sum(p.stat().st_size for p in hf.glob("*.safetensors")))
    if r.llmapi.compressed_tensors:
        from trtpipe.export.compressed import export_compressed

        ct = ctx.out_dir / CT_DIR
        ct.mkdir()
        with ctx.progress("export: compressed-tensors checkpoint", total=None) as bar:
            cfg = export_compressed(
                ctx.inputs["checkpoint"],
                model_dir(r),
                ctx.inputs.get("calibrate"),
                ct,
                max_shard_bytes=r.llmapi.max_shard_bytes,
                progress=lambda s: bar.advance(1),
                **common,
            )
        ctx.info.update(compressed_tensors=cfg)


EXPORT_STAGE = Stage(
    name="export",
    sections=("quantization", "llmapi.compressed_tensors", "llmapi.max_shard_bytes"),
    inputs=("checkpoint", "calibrate"),
    run=run,
    files=model_files,  # config.json of the HF source is rewritten into the export
    enabled=is_llmapi,
    description="unified HF checkpoint (ModelOpt format) for trtllm-serve / Triton llmapi [+ compressed-tensors]",
)


def _adapter_files(recipe: Recipe) -> list:
    """The LoRA adapters' files (their fingerprints enter the llmapi stage's key: a retrained adapter is recopied)."""
    from trtpipe.export.lora import adapter_dirs

    return [d / f for d in adapter_dirs(recipe).values() for f in ("adapter_config.json", "adapter_model.safetensors")]


def run_serving(ctx: StageContext) -> None:
    from trtpipe.export.serving import write_serving
    from trtpipe.triton.llmapi_repo import write_llmapi_repo

    hf_dir = ctx.inputs["export"] / HF_DIR
    info = write_serving(ctx.recipe, hf_dir, ctx.out_dir)
    lora_dir = Path(info["lora_dir"]) if info.get("lora_dir") else None
    write_llmapi_repo(ctx.recipe, ctx.out_dir / "triton_repo", str(hf_dir.resolve()), lora_dir)
    ctx.info.update(info)
    ctx.log.info("serve with: %s", info["serve"])


LLMAPI_STAGE = Stage(
    name="llmapi",
    sections=(
        "llmapi",
        "engine",
        "parallel",
        "triton.streaming",
        "triton.scheduler_policy",
        "quantization.kv_cache",
        "serving.guided_decoding_backend",
        "serving.tool_parser",  # serve.sh's --tool_parser / --reasoning_parser
        "serving.reasoning_parser",
        "lora",
        "speculative",  # speculative_config
    ),
    inputs=("export",),
    files=lambda recipe: _adapter_files(recipe),
    run=run_serving,
    enabled=is_llmapi,
    description="extra_llm_api_options YAML, trtllm-serve / srun / mpirun lines, Triton llmapi repository",
)
