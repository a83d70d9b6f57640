"""LoRA adapters of a recipe: the rules that check them against the base before any build, the ``lora_config`` of
the trtllm-serve YAML (and the Triton ``llmapi`` model), and the adapters copied beside the export.

Upstream (TensorRT-LLM ``tensorrt_llm/lora_helper.py@585c7565``): ``LoraConfig`` holds ``lora_dir``,
``lora_ckpt_source`` ("hf"), ``max_lora_rank``, ``lora_target_modules``, ``max_loras``, ``max_cpu_loras``;
``get_default_trtllm_modules_to_hf_modules`` names the target modules (``attn_q`` = q_proj, ``attn_k``,
``attn_v``, ``attn_dense`` = o_proj, ``mlp_h_to_4h`` = gate_proj, ``mlp_gate`` = up_proj, ``mlp_4h_to_h`` =
down_proj). The key set is written for TensorRT-LLM 1.2 only (older releases: unverified, refused).

What is refused, each in one line naming the key:
- (``target: engine``: built by :mod:`trtpipe.engine.lora_build`, whose rules refuse what it does not build);
- a quantized base other than FP8: TensorRT-LLM's LoRA page shows LoRA on an FP8 base only
  (``docs/source/features/lora.md@89fd9b74``, "LoRA with Quantization"); INT4 AWQ, NVFP4 and the rest are
  unconfirmed there, so refused rather than guessed;
- an adapter whose base does not match the model (module names, shapes), whose rank is above ``max_lora_rank``, or
  which uses a PEFT feature the runtime does not compute (:mod:`trtpipe.runtime.lora`);
- Dynamo: its feature matrix lists LoRA for the vLLM backend only, not TensorRT-LLM (Dynamo docs v1.1.0 to v1.3.0,
  ``resources/feature-matrix``, row "LoRA"): :func:`dynamo_refusal`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Optional

from trtpipe.errors import TrtpipeError
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding, model_dir
from trtpipe.recipe.schema import Recipe

# HF module -> TensorRT-LLM LoRA module (get_default_trtllm_modules_to_hf_modules, lora_helper.py@585c7565, inverted)
TRTLLM_MODULES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "up_proj": "mlp_gate",
    "down_proj": "mlp_4h_to_h",
}
LORA_QUANT = ("none", "fp8")  # bases TensorRT-LLM's LoRA page shows (lora.md@89fd9b74)
LORA_VERSIONS = ("1.2",)
ADAPTERS_DIR = "lora"  # beside the export: <llmapi artifact>/lora/<name>/
DYNAMO_LORA_DOCS = "https://docs.nvidia.com/dynamo/v1.3.0/resources/feature-matrix"


def adapter_dirs(recipe: Recipe) -> dict[str, Path]:
    """Each adapter's directory as the recipe names it (``hf://`` through the hub cache)."""
    from trtpipe.runtime.lora import resolve_source

    return {name: resolve_source(name, src, recipe.base_dir) for name, src in recipe.lora.adapters.items()}


def target_modules(recipe: Recipe, dirs: Optional[dict[str, Path]] = None) -> list[str]:
    """``lora_target_modules``: the TensorRT-LLM names of every module any adapter targets, in table order."""
    from trtpipe.runtime.lora import BaseLayout, target_modules as hf_targets

    layout = BaseLayout.of(model_dir(recipe))
    dirs = adapter_dirs(recipe) if dirs is None else dirs
    used = {t for name, d in dirs.items() for t in hf_targets(name, d, layout)}
    return [trt for hf, trt in TRTLLM_MODULES.items() if hf in used]


def lora_options(recipe: Recipe, served_dirs: list[str], modules: list[str]) -> dict:
    """The dotted ``lora_config`` keys of the extra_llm_api_options YAML (empty without adapters)."""
    if not recipe.lora.adapters:
        return {}
    lora = recipe.lora
    return {
        "lora_config.lora_dir": list(served_dirs),
        "lora_config.lora_ckpt_source": "hf",
        "lora_config.max_lora_rank": lora.max_lora_rank,
        "lora_config.max_loras": lora.max_loras,
        "lora_config.max_cpu_loras": lora.max_cpu_loras,
        "lora_config.lora_target_modules": list(modules),
    }


def copy_adapters(recipe: Recipe, out: Path) -> dict[str, Path]:
    """Copy each adapter's ``adapter_config.json`` and weights into ``out/lora/<name>/`` (what a deployment mounts)."""
    copied = {}
    for name, src in adapter_dirs(recipe).items():
        dst = Path(out) / ADAPTERS_DIR / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not (src / f).is_file():
                raise TrtpipeError(f"lora.adapters.{name}: {src / f} is missing")
            shutil.copy2(src / f, dst / f)
        copied[name] = dst
    return copied


def dynamo_refusal(recipe: Recipe) -> Optional[str]:
    """Why Dynamo cannot serve this recipe's adapters (None without adapters)."""
    if not recipe.lora.adapters:
        return None
    return (
        f"lora.adapters: NVIDIA Dynamo does not serve LoRA adapters on TensorRT-LLM (its feature matrix lists LoRA "
        f"for the vLLM backend only: {DYNAMO_LORA_DOCS}); serve this recipe with trtpipe serve (the trtllm-serve "
        "twin) or Triton's llmapi model, or drop lora.adapters"
    )


def _lora_rules(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    lora = recipe.lora
    if not lora.adapters:
        return
    if recipe.quantization.algo not in LORA_QUANT:
        yield (
            "quantization.algo",
            (
                f"{recipe.quantization.algo} with lora.adapters: TensorRT-LLM's LoRA page shows LoRA on an FP8 base only "
                "(docs/source/features/lora.md@89fd9b74); use fp8 or none"
            ),
        )
    if recipe.llmapi.version not in LORA_VERSIONS:
        yield "llmapi.version", f"{recipe.llmapi.version}: lora_config is written for TensorRT-LLM 1.2 only"
    if lora.max_cpu_loras < lora.max_loras:
        yield (
            "lora.max_cpu_loras",
            (
                f"{lora.max_cpu_loras} is below lora.max_loras {lora.max_loras}: the host cache holds every active adapter"
            ),
        )
    if m is None:
        return
    from trtpipe.runtime.lora import BaseLayout, load_adapter, resolve_source

    try:
        layout = BaseLayout.of(model_dir(recipe))
    except TrtpipeError as exc:
        yield "model.source", str(exc)
        return
    for name, src in lora.adapters.items():
        try:
            load_adapter(name, resolve_source(name, src, recipe.base_dir), layout, lora.max_lora_rank)
        except TrtpipeError as exc:
            yield f"lora.adapters.{name}", str(exc)


LORA_RULES = (_lora_rules,)


def adapter_params(recipe: Recipe) -> dict[str, int]:
    """Elements of each adapter's ``lora_A`` and ``lora_B`` tensors, read from the safetensors header (no weights)."""
    from safetensors import safe_open

    out = {}
    for name, d in adapter_dirs(recipe).items():
        with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
            total = 0
            for key in f.keys():
                if ".lora_A." in key or ".lora_B." in key:
                    n = 1
                    for dim in f.get_slice(key).get_shape():
                        n *= dim
                    total += n
        out[name] = total
    return out


def cache_line(recipe: Recipe, dtype_bytes: int, tp: int) -> Optional[str]:
    """The planner's LoRA cache line: the largest adapter at the model's dtype, per GPU (A or B of each linear is
    split over tp), times ``max_loras`` (device) and ``max_cpu_loras`` (host). None without adapters."""
    if not recipe.lora.adapters:
        return None
    sizes = {n: p * dtype_bytes for n, p in adapter_params(recipe).items()}
    name = max(sizes, key=sizes.get)
    largest, lora = sizes[name], recipe.lora
    mib = 1 << 20
    return (
        f"LoRA cache: {len(sizes)} adapters, largest '{name}' {largest / mib:.2f} MiB (~{largest / tp / mib:.2f} MiB "
        f"per GPU at tp {tp}); device max_loras {lora.max_loras} x that = {lora.max_loras * largest / tp / mib:.2f} MiB "
        f"per GPU, host max_cpu_loras {lora.max_cpu_loras} x that = {lora.max_cpu_loras * largest / mib:.2f} MiB "
        "(TensorRT-LLM sizes its PEFT cache apart from the KV pool: not deducted above)"
    )
