"""The lossy steps of converting a pre-quantized source for the engine target: named, opt-in, refused unless listed.

Every other conversion of a pre-quantized checkpoint is an exact re-layout (codes copied, scales widened). Two are
not, because TensorRT-LLM's checkpoint has no place for what the source stores:

* ``fp8_requantize``: per-tensor FP8 projections fused into one linear (q/k/v, gate/up) share one weight scale in
  TensorRT-LLM; members stored with a smaller scale are requantized to the max (one FP8 E4M3 rounding per element:
  relative error at most 2^-4, or 2^-10 of the shared scale near zero). Needed only where the members' scales differ.
* ``zero_point_rounding``: zero-point INT4 (AutoAWQ GEMM, asymmetric GPTQ / compressed-tensors) becomes W4A16_AWQ's
  ``zero = -zero_point * s`` in the model dtype (one rounding: relative 2^-8 in bfloat16, 2^-11 in float16; exact in
  float32, where nothing is to accept).

A recipe accepts them by name in ``model.allow_lossy_import`` (:data:`KEY`); ``trtpipe validate`` (from the scale
scalars and the model dtype) and the conversion itself (:class:`trtpipe.quant.imported.trtllm.ImportedLinears`, as
the backstop) refuse a step that is needed and not listed, in one line saying where and why. The llmapi target
passes sources through or re-lays them out exactly: it has no lossy step. Pure functions only: the MoE path calls
:func:`fp8_requantize_why` for its fused per-expert w1/w3 as the dense path does for q/k/v and gate/up.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from trtpipe.errors import CheckpointError

KEY = "model.allow_lossy_import"
FP8_REQUANTIZE = "fp8_requantize"
ZERO_POINT_ROUNDING = "zero_point_rounding"
# step -> what it does (the recipe schema's choices and docs/reference/prequantized.md#lossy-import-steps)
STEPS: dict[str, str] = {
    FP8_REQUANTIZE: "per-tensor FP8 members of a fused linear (q/k/v, gate/up) with different weight scales are "
    "requantized to the max scale (one FP8 rounding per element of the smaller-scale members)",
    ZERO_POINT_ROUNDING: "zero-point INT4 becomes W4A16_AWQ's zero = -zero_point * scale, rounded once to the model "
    "dtype (exact in float32)",
}
# model dtype -> unit roundoff of one rounding to it (0: exact); FP8 E4M3 has 3 mantissa bits
UNIT_ROUNDOFF = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FP8_UNIT_ROUNDOFF = 2.0**-4
FP8_MIN_NORMAL = 2.0**-6  # of the code; below it E4M3 steps are 2^-9 (absolute, in units of the scale)


def accept_hint(step: str) -> str:
    return f"add {step} to {KEY} to accept"


def members_label(modules: Sequence[str]) -> tuple[str, str]:
    """('model.layers.0.self_attn', 'q_proj/k_proj/v_proj') of the fused members' HF module names."""
    parents = {m.rpartition(".")[0] for m in modules}
    if len(parents) == 1:
        return parents.pop(), "/".join(m.rpartition(".")[2] for m in modules)
    return modules[0], "/".join(modules)


def fp8_requantize_why(modules: Sequence[str], scales: Sequence[float], fused: str) -> Optional[str]:
    """Why fusing these per-tensor FP8 members needs ``fp8_requantize`` (None: their scales are equal, the fusion
    is exact). ``scales`` are the members' stored weight scales, ``fused`` the TensorRT-LLM linear."""
    if len(set(scales)) <= 1:
        return None
    parent, names = members_label(modules)
    values = ", ".join(f"{s:.6g}" for s in scales)
    return (
        f"{parent}: {names} weight scales differ ({values}); fusing them into TensorRT-LLM's {fused} requantizes "
        "to the max (one FP8 rounding)"
    )


def zero_point_why(fmt_name: str, dtype: str) -> Optional[str]:
    """Why a zero-point INT4 source at model dtype ``dtype`` needs ``zero_point_rounding`` (None: float32, exact)."""
    if not UNIT_ROUNDOFF.get(dtype, 1.0):
        return None
    return (
        f"{fmt_name} has zero points: TensorRT-LLM's W4A16_AWQ zero = -zero_point * scale is rounded to the model "
        f"dtype {dtype} (relative 2^{math.log2(UNIT_ROUNDOFF[dtype]):.0f}; exact only with model.dtype: float32)"
    )


def refusal(step: str, why: str, more: int = 0) -> str:
    """The one line naming the step, where and why, and the key to set."""
    also = f" (and {more} more fused linear{'s' if more > 1 else ''})" if more else ""
    return f"{why}{also}; {accept_hint(step)}"


def require(step: str, why: Optional[str], allowed: Iterable[str], where: str) -> None:
    """Raise unless the step is not needed (``why`` None) or the recipe accepts it."""
    if why is not None and step not in tuple(allowed):
        raise CheckpointError(f"{where}: {refusal(step, why)}")
