"""Rules on ``llmapi.options`` (the TorchLlmArgs keys a recipe writes as given, e.g. imported from NVIDIA's
database configs): every key in the key table of ``llmapi.version`` (:func:`trtpipe.export.serving.checked`), and
``moe_config.backend`` a backend of ``MoeConfig`` that the GPU and the checkpoint's format can run.

MoE backends by GPU and checkpoint, as DeepSeek-R1's deployment guide gates them (NVIDIA/TensorRT-LLM
``docs/source/deployment-guide/deployment-guide-for-deepseek-r1-on-trtllm.md@7c22bbf9f6f7cafaf4c675ac2eb311ef17ec0406``,
"MoE Backend Support Matrix"): H100/H200 FP8 -> CUTLASS; B200/GB200 with EP <= 8: NVFP4 -> CUTLASS or TRTLLM,
FP8 -> DEEPGEMM; GB200 NVL72 with EP > 8: WIDEEP. NVIDIA's own database config for DeepSeek-R1-0528 FP8 on B200
(``examples/configs/database/deepseek-ai/DeepSeek-R1-0528/B200/1k1k_tp8_conc1.yaml@010405f19198a7318d08009ab311fa38b445df89``)
runs TRTLLM, which the guide's row does not list: the guide's table is older than that config, so TRTLLM is taken
for Blackwell FP8 too (that is the one addition, and it is sourced). The gate is the guide's, so it covers the
DeepSeek-V3 architecture (DeepSeek-V3/R1, Kimi-K2); other MoE models get the name check only.

Backend names: ``MoeConfig.backend``'s Literal in the stored ``llm_args.py`` revisions (CUTLASS, CUTEDSL, WIDEEP,
TRTLLM, DEEPGEMM, VANILLA, TRITON; newer revisions add AUTO as the default and DENSEGEMM, MARLIN,
MEGAMOE_DEEPGEMM). Which of the newer names 1.3.0rc takes is not confirmed, so only the older set plus AUTO is
accepted.
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.export.serving import UnknownLLMAPIKey, checked
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe

MOE_BACKENDS = ("AUTO", "CUTLASS", "CUTEDSL", "WIDEEP", "TRTLLM", "DEEPGEMM", "VANILLA", "TRITON")
GUIDE = "deployment-guide-for-deepseek-r1-on-trtllm.md@7c22bbf9"
# model types the guide's matrix is about (DeepseekV3ForCausalLM)
GUIDED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# (GPU architecture, checkpoint format, EP > 8) -> backends that run it
MATRIX: dict[tuple[str, str, bool], tuple[str, ...]] = {
    ("hopper", "fp8", False): ("CUTLASS",),
    ("hopper", "fp8", True): ("CUTLASS",),
    ("blackwell", "nvfp4", False): ("CUTLASS", "TRTLLM"),
    ("blackwell", "fp8", False): ("DEEPGEMM", "TRTLLM"),  # TRTLLM: the B200 database config @010405f1
    ("blackwell", "nvfp4", True): ("WIDEEP",),
    ("blackwell", "fp8", True): ("WIDEEP",),
}
_ARCH = (
    ("h100", "hopper"),
    ("h200", "hopper"),
    ("gh200", "hopper"),
    ("b200", "blackwell"),
    ("gb200", "blackwell"),
    ("b300", "blackwell"),
    ("gb300", "blackwell"),
)


def gpu_arch(gpu: str) -> Optional[str]:
    for prefix, arch in _ARCH:
        if gpu.startswith(prefix):
            return arch
    return None


def checkpoint_format(recipe: Recipe) -> Optional[str]:
    """``fp8`` / ``nvfp4`` as the MoE experts are served (the recipe's algo, else the source's own format)."""
    algo = recipe.quantization.algo
    if algo.startswith("fp8"):
        return "fp8"
    if algo.startswith("nvfp4"):
        return "nvfp4"
    if algo != "none":
        return None
    from trtpipe.quant.imported.detect import detect
    from trtpipe.recipe.rules import model_dir

    try:
        fmt = detect(model_dir(recipe))
    except Exception:  # an unreadable source is reported by the model rule
        return None
    qa = (fmt.quant_algo or "") if fmt is not None else ""
    return "fp8" if qa.startswith("FP8") else "nvfp4" if qa.startswith("NVFP4") else None


def moe_backend_problem(backend: str, model_type: str, gpu: str, fmt: Optional[str], ep: int) -> Optional[str]:
    if backend not in MOE_BACKENDS:
        return f"moe_config.backend '{backend}' is not a MoeConfig backend (one of {', '.join(MOE_BACKENDS)})"
    arch = gpu_arch(gpu)
    if backend == "AUTO" or model_type not in GUIDED_MODEL_TYPES or arch is None or fmt is None:
        return None
    allowed = MATRIX.get((arch, fmt, ep > 8))
    if allowed is not None and backend not in allowed:
        return (
            f"moe_config.backend {backend} does not run {fmt.upper()} {model_type} MoE on {gpu}"
            f"{' with EP > 8' if ep > 8 else ''} (TensorRT-LLM's {GUIDE}: {', '.join(allowed)})"
        )
    return None


def _options(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    options = recipe.llmapi.options
    if not options:
        return
    if recipe.target != "llmapi":
        yield "llmapi.options", "llmapi.options is written by the llmapi target only; set target: llmapi"
        return
    try:
        checked(options, recipe.llmapi.version)
    except UnknownLLMAPIKey as exc:
        yield "llmapi.options", str(exc)
    if recipe.speculative.enabled or recipe.lora.adapters:
        yield (
            "llmapi.options",
            "llmapi.options is written as given: put speculative_config / lora_config there, not in the "
            "speculative / lora sections as well",
        )
    backend = (options.get("moe_config") or {}).get("backend")
    if backend is not None:
        model_type = m.model_type if m is not None else ""
        ep = recipe.parallel.moe_ep if recipe.parallel.moe_ep > 0 else recipe.parallel.tp
        why = moe_backend_problem(str(backend), model_type, recipe.engine.gpu, checkpoint_format(recipe), ep)
        if why:
            yield "llmapi.options", why


OPTIONS_RULES: tuple[Rule, ...] = (_options,)
