"""The ``repo`` build stage: the Triton model repository from the engine stage's output.

It reads the engine dir (TensorRT engines or the CPU twin) and the checkpoint artifact, beside which the
tokenizer files and ``generation_config.json`` were copied (docs/architecture.md). The installed tritonclient
version (the config messages come from its ``model_config_pb2``) and the python model code enter the key.
"""

from __future__ import annotations

from trtpipe.pipeline.stage import Stage, StageContext


def _run(ctx: StageContext) -> None:
    from trtpipe.triton.repo import write_repo

    kv_plan(ctx)
    from trtpipe.stages.draft_engine import ENGINE_DIR

    draft = ctx.inputs["draft_engine"] / ENGINE_DIR if "draft_engine" in ctx.inputs else None
    configs = write_repo(
        ctx.recipe, ctx.inputs["engine"], ctx.inputs["checkpoint"], ctx.out_dir, draft_engine_dir=draft
    )
    ctx.info["models"] = sorted(configs)
    ctx.info["backend"] = configs["tensorrt_llm"].backend
    ctx.log.info("model repository: %s (%s)", ctx.out_dir, ", ".join(sorted(configs)))


def kv_plan(ctx: StageContext) -> None:
    """The KV pool the repository's ``engine.kv_cache`` settings give the engine (planner.kv_pool over the engine
    stage's plan): refused when one sequence of max_seq_len does not fit, else recorded. Here, not in the engine
    stage, because this stage's key holds ``engine.kv_cache`` (a runtime setting: changing it rewrites the
    repository, never the engine). An engine without a plan file (built before it existed) is not planned."""
    from trtpipe.engine.planner import PLAN_FILE, kv_pool
    from trtpipe.errors import EngineError
    from trtpipe.jsonfile import read_json

    path = ctx.inputs["engine"] / PLAN_FILE
    if not path.is_file():
        return
    pool, refusal = kv_pool(read_json(path, "the engine stage's plan", EngineError), ctx.recipe.engine.kv_cache)
    if refusal:
        raise EngineError(refusal)
    ctx.info["kv_plan"] = pool


def _extra_key(recipe):
    """tritonclient's version and the python model code: either changes what the repository holds."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from trtpipe.triton.repo import MODEL_CODE

    try:
        tc = version("tritonclient")
    except PackageNotFoundError:
        tc = None
    code = {
        str(p.relative_to(MODEL_CODE)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        for p in sorted(MODEL_CODE.glob("*/1/model.py"))
    }
    return {"tritonclient": tc, "model_code": code}


REPO_STAGE = Stage(
    name="repo",
    # Every recipe field write_repo reads (tests/triton_serving/test_repo.py records them): the twin's
    # executor_extras carry serving.* (request_timeout_s, max_queue_size) and the executor knobs (lora, speculative), and
    # trtpipe_repo.json the recipe's name.
    sections=("name", "triton", "engine.kv_cache", "serving", "lora", "speculative"),
    inputs=("checkpoint", "engine", "draft_engine"),
    run=_run,
    extra_key=_extra_key,
    enabled=lambda recipe: recipe.target == "engine",
    description="Triton model repository (preprocessing, tensorrt_llm, postprocessing, ensemble[, bls, draft])",
)
