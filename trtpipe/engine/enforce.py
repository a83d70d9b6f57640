"""The builder's enforced combinations, applied by trtpipe itself before anything is emitted.

Source: ``builder.build`` of TensorRT-LLM 1.0–1.2 ``tensorrt_llm/builder.py``, restated in
docs/reference/trtllm-build.md#builder-enforced-combinations.

``trtllm-build`` silently rewrites some plugin settings and raises on others. trtpipe applies the same
rewrites (:func:`enforce`) so the flags it emits are the values the engine will really have, and lists
every rewrite (:class:`Change`) and every combination the builder rejects (:func:`rejections`), each with
its reason, so validation can report them before a long build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Optional

from trtpipe.engine import upstream
from trtpipe.formats.schemes import BY_QUANT_ALGO, quant_algos, tensor_core_rejection

# Architectures for which reduce_fusion survives (builder: Llama, Gemma2, Medusa).
REDUCE_FUSION_ARCHS = ("LlamaForCausalLM", "Gemma2ForCausalLM", "MedusaForCausalLM")
LLAMA_ARCHS = ("LlamaForCausalLM",)
# the scheme table's columns (trtpipe.formats.schemes), as the builder groups quant_algos
FP8_CONTEXT_FMHA_ALGOS = quant_algos(lambda s: s.fp8_context_fmha)
FP8_ALGOS = quant_algos(lambda s: s.tensor_cores == "FP8")
# builder.build on SM 100-119: the kind of quant_algo it rejects -> what its message adds
BLACKWELL_DC_NOTE = {"weight-only": " (SM 100-119)", "SmoothQuant": " (SM 100-119)", "per-channel/per-token": ""}
# PluginConfig.validate: {exact SM: fields it rejects} (upstream table).
VALIDATE_REJECTS_BY_SM = upstream.VALIDATE_REJECTS_BY_SM[0]
PAGED_STATE_ARCHITECTURES = upstream.PAGED_STATE_ARCHITECTURES[0]


@dataclass(frozen=True)
class Target:
    """What the builder decides with: the GPU's SM, the checkpoint's architecture/quantization, the mapping."""

    sm: int
    architecture: str
    quant_algo: Optional[str]
    kv_cache_quant_algo: Optional[str]
    tp: int = 1
    pp: int = 1
    group_size: Optional[int] = None  # of a group-wise quant_algo (None: not group-wise or not known)


@dataclass(frozen=True)
class Change:
    field: str
    old: Any
    new: Any
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {_spell(self.old)} -> {_spell(self.new)} ({self.reason})"


def _spell(v: Any) -> str:
    return ("enable" if v else "disable") if isinstance(v, bool) else str(v)


def is_blackwell_dc(sm: int) -> bool:
    """SM 100-119: the range where the builder rejects weight-only, INT8 KV and SmoothQuant."""
    low, high = upstream.BLACKWELL_DC_SM_RANGE[0]
    return low <= sm < high


def enforce(plugins: dict[str, Any], t: Target, explicit: Collection[str] = ()) -> tuple[dict[str, Any], list[Change]]:
    """Apply the builder's rewrites in its order; return the final fields and what changed (with why).

    ``explicit``: the plugin fields given on the command line (only ``--gemm_plugin disable`` matters: it is
    the one way to keep an NVFP4 model off the NVFP4 GEMM plugin).
    """
    p = dict(plugins)
    changes: list[Change] = []

    def force(name: str, value: Any, reason: str) -> None:
        if p[name] != value:
            changes.append(Change(name, p[name], value, reason))
            p[name] = value

    if t.architecture not in PAGED_STATE_ARCHITECTURES:  # BuildConfig.update_kv_cache_type
        force(
            "paged_state",
            False,
            f"paged_state is for Mamba/RecurrentGemma; the builder sets it off for {t.architecture}",
        )
    if p["reduce_fusion"] and not (t.tp > 1 and t.architecture in REDUCE_FUSION_ARCHS):
        why = "needs tp > 1" if t.tp <= 1 else f"not supported for {t.architecture}"
        force("reduce_fusion", False, f"reduce_fusion {why} (Llama, Gemma2 or Medusa)")
    if p["user_buffer"] and not p["reduce_fusion"]:
        force("user_buffer", False, "user_buffer needs reduce_fusion")
    nvfp4_llama = t.architecture in LLAMA_ARCHS and t.quant_algo == "NVFP4" and not p["reduce_fusion"]
    if p["norm_quant_fusion"] and not nvfp4_llama:
        force("norm_quant_fusion", False, "norm_quant_fusion needs a Llama NVFP4 model without reduce_fusion")

    fp8_kv = t.kv_cache_quant_algo == "FP8"
    if not p["context_fmha"]:
        force("use_fp8_context_fmha", False, "context_fmha is off")
        force("use_paged_context_fmha", False, "context_fmha is off")
    if t.quant_algo not in FP8_CONTEXT_FMHA_ALGOS:
        force(
            "use_fp8_context_fmha",
            False,
            f"FP8 context FMHA needs quant_algo {_or(FP8_CONTEXT_FMHA_ALGOS)} (got {t.quant_algo})",
        )
        if fp8_kv:
            force(
                "use_paged_context_fmha",
                False,
                f"an FP8 KV cache with quant_algo {t.quant_algo} disables paged context FMHA",
            )
    if t.sm < 89:
        force("use_fp8_context_fmha", False, f"FP8 context FMHA needs SM >= 8.9 (target is {t.sm // 10}.{t.sm % 10})")
        if fp8_kv:
            force("use_paged_context_fmha", False, "an FP8 KV cache below SM 8.9 disables paged context FMHA")
    if p["use_paged_context_fmha"]:
        if not fp8_kv:
            force("use_fp8_context_fmha", False, "FP8 paged context FMHA needs an FP8 KV cache")
        else:
            force("use_fp8_context_fmha", True, "paged context FMHA with an FP8 KV cache is always FP8")
    if t.kv_cache_quant_algo == "INT8":
        force("use_paged_context_fmha", False, "an INT8 KV cache disables paged context FMHA (and with it KV reuse)")
    (algo, gemm), _ = upstream.NVFP4_GEMM
    if t.quant_algo == algo and not ("gemm_plugin" in explicit and p["gemm_plugin"] == "disable"):
        force("gemm_plugin", gemm, "an NVFP4 model gets the NVFP4 GEMM plugin unless --gemm_plugin disable is given")
    return p, changes


def _or(names: tuple[str, ...]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def tensor_core_rejections(t: Target) -> list[tuple[str, str]]:
    """The quantization whose GEMMs need tensor cores the GPU lacks (the scheme table's tensor_cores column: FP8
    below SM 8.9, FP4 below SM 10.0). These are the hardware's limits, not the builder's, so they hold for
    TensorRT-LLM's PyTorch backend too (the llmapi target's validation asks only this). An FP8 KV cache alone is
    allowed (the engine's rewrites handle it)."""
    why = tensor_core_rejection(t.sm, t.quant_algo)
    return [("quantization.algo", why)] if why else []


def rejections(plugins: dict[str, Any], t: Target) -> list[tuple[str, str]]:
    """Combinations the builder raises on, plus :func:`tensor_core_rejections`; as (field or recipe key, reason)."""
    out: list[tuple[str, str]] = []
    sm = f"SM {t.sm // 10}.{t.sm % 10}"
    if is_blackwell_dc(t.sm):
        kind = BY_QUANT_ALGO[t.quant_algo].blackwell_dc if t.quant_algo in BY_QUANT_ALGO else None
        if kind:
            out.append(
                (
                    "quantization.algo",
                    f"{kind} {t.quant_algo} is rejected by the builder on {sm}{BLACKWELL_DC_NOTE[kind]}",
                )
            )
        if t.kv_cache_quant_algo == "INT8":
            out.append(("quantization.kv_cache", f"an INT8 KV cache is rejected by the builder on {sm} (SM 100-119)"))
    for name in VALIDATE_REJECTS_BY_SM.get(t.sm, ()):
        if plugins.get(name, "disable") not in ("disable", False):
            out.append((name, f"{name} is rejected on {sm} (PluginConfig.validate)"))
    out.extend(tensor_core_rejections(t))
    allowed = upstream.FINEGRAINED_GROUP_SIZES[0].get(t.quant_algo)
    if allowed and t.group_size is not None and t.group_size not in allowed:
        sizes = " or ".join(map(str, allowed))
        out.append(
            (
                "quantization.group_size",
                f"{t.quant_algo} with group_size {t.group_size}: TensorRT-LLM's "
                f"group-wise INT4 GEMM runs group_size {sizes} only (it throws at "
                "inference, after the build)",
            )
        )
    if plugins.get("streamingllm"):
        out.append(("streamingllm", "StreamingLLM is no longer supported in TensorRT-LLM 1.x (the builder asserts)"))
    if plugins.get("pp_reduce_scatter") and t.architecture != "MixtralForCausalLM":
        out.append(
            ("pp_reduce_scatter", f"pp_reduce_scatter is only for Mixtral (the builder asserts; got {t.architecture})")
        )
    for name in upstream.SWIGLU_PLUGINS_NEED_FUSED_MLP[0]:
        if plugins.get(name, "disable") != "disable" and not plugins.get("use_fused_mlp"):
            out.append((name, f"{name} needs use_fused_mlp (the builder raises)"))
    if plugins.get("gemm_plugin") == "fp8" and t.quant_algo not in FP8_ALGOS:
        out.append(("gemm_plugin", f"gemm_plugin fp8 needs an FP8 model (quant_algo is {t.quant_algo})"))
    (fp4_algo, fp4_gemm), _ = upstream.NVFP4_GEMM
    if plugins.get("gemm_plugin") == fp4_gemm and t.quant_algo != fp4_algo:
        out.append(("gemm_plugin", f"gemm_plugin {fp4_gemm} needs an {fp4_algo} model (quant_algo is {t.quant_algo})"))
    return out
