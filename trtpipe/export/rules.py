"""Recipe rules of the llmapi target, checked at validation time (before any weight is read).

TensorRT-LLM's PyTorch backend loads a pre-quantized checkpoint through one linear method per ``quant_algo``;
INT8 SmoothQuant has none (``ValueError('unsupported quant mode')`` at load) and an INT8 KV cache is rejected for
pre-quantized checkpoints (only FP8 or NVFP4). Those are refused here with the reason and what to use instead,
rather than after calibration and export.
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.export.formats import MOE_EXPORT_ALGOS
from trtpipe.models.hfconfig import HFModelInfo
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe

# recipe algo -> why the llmapi target cannot take it, and what to use instead
LLMAPI_REFUSED_ALGOS = {
    "int8_sq": ("INT8 SmoothQuant (W8A8_SQ_PER_CHANNEL) cannot be loaded by TensorRT-LLM's PyTorch backend "
                "(it has no linear method for it)",
                "use fp8 or fp8_pc_pt (Ada/Hopper/Blackwell), w4a8_awq or int4_awq, or target: engine "
                "(TensorRT-LLM <= 1.2)"),
}
LLMAPI_REFUSED_KV = {
    "int8": ("an INT8 KV cache is rejected by TensorRT-LLM's PyTorch backend for pre-quantized checkpoints "
             "(only FP8 or NVFP4)",
             "use kv_cache: fp8, or target: engine (TensorRT-LLM <= 1.2)"),
}
# recipe algos that only the llmapi export writes (no TRT-LLM-checkpoint layout in trtpipe)
LLMAPI_ONLY_ALGOS = ("fp8_pc_pt", "nvfp4")


def _llmapi_target(recipe: Recipe, m: Optional[HFModelInfo]) -> Iterable[Finding]:
    q = recipe.quantization
    if recipe.target != "llmapi":
        if q.algo in LLMAPI_ONLY_ALGOS:
            yield "quantization.algo", (f"{q.algo} is written only for target: llmapi (the engine path's "
                                        "checkpoint writer has no layout for it); set target: llmapi or use fp8")
        return
    if q.algo in LLMAPI_REFUSED_ALGOS:
        why, alternatives = LLMAPI_REFUSED_ALGOS[q.algo]
        yield "quantization.algo", f"{q.algo} is refused for target llmapi: {why}; {alternatives}"
    if q.kv_cache in LLMAPI_REFUSED_KV:
        why, alternatives = LLMAPI_REFUSED_KV[q.kv_cache]
        yield "quantization.kv_cache", f"kv_cache {q.kv_cache} is refused for target llmapi: {why}; {alternatives}"
    if m is not None and m.is_moe and q.algo not in MOE_EXPORT_ALGOS:
        yield "quantization.algo", (f"{q.algo}: the llmapi export writes mixture-of-experts experts unquantized, in "
                                    f"fp8, nvfp4 or int4_awq (supported: {', '.join(MOE_EXPORT_ALGOS)}); use one of "
                                    "them")
    if m is not None and q.algo == "nvfp4":
        import fnmatch

        from trtpipe.quant.rules import linear_dims

        for name, (_, in_f) in linear_dims(m).items():
            if in_f % 16 and not any(fnmatch.fnmatchcase(f"transformer.layers.0.{name}", p) for p in q.exclude):
                yield "quantization.algo", (f"nvfp4: {name} has in_features {in_f}, not a multiple of 16 (NVFP4 "
                                            f"blocks); add '*{name}' to quantization.exclude")
    if recipe.llmapi.compressed_tensors and q.algo not in COMPRESSED_TENSORS_ALGOS:
        yield "llmapi.compressed_tensors", (f"no compressed-tensors scheme for quantization.algo {q.algo}; "
                                            f"supported: {', '.join(COMPRESSED_TENSORS_ALGOS)}")


# recipe algo -> compressed-tensors scheme written (see trtpipe.export.compressed)
COMPRESSED_TENSORS_ALGOS = ("fp8", "fp8_pc_pt", "int4_wo")


EXPORT_RULES: tuple[Rule, ...] = (_llmapi_target,)
