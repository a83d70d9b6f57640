"""Plugin presets: declarative PluginConfig settings per GPU architecture and precision (``plugins/*.yaml``).

A preset file::

    description: Hopper (SM 9.0), FP8 weights and activations with an FP8 KV cache
    match: {sm: [90], quant_algo: [FP8], kv_cache_quant_algo: [FP8, null]}
    plugins: {gpt_attention_plugin: auto, gemm_plugin: fp8, use_fp8_context_fmha: true, ...}

``plugins`` may only name fields of :data:`FIELDS` (the PluginConfig fields ``trtllm-build`` exposes on its
command line, contract §4.1, plus ``paged_kv_cache``, which is emitted as ``--kv_cache_type``). A recipe names a
preset (``engine.plugins.preset``) or leaves ``auto``, which takes the first preset (sorted by name) whose
``match`` fits the target GPU and the checkpoint's quantization; ``engine.plugins.overrides`` then replaces fields.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import yaml

from trtpipe.errors import EngineError

DTYPES = ("auto", "float16", "float32", "bfloat16", "int32", "disable")


@dataclass(frozen=True)
class Field:
    """One PluginConfig field: its kind, the 1.x default (as the CLI spells it) and whether it is a CLI flag."""

    name: str
    kind: str  # "dtype" (a plugin: dtype string or disable), "bool" (enable/disable feature), "int"
    default: Any  # dtype fields: "auto"/"disable"/...; bool fields: True/False
    cli: bool = True
    extra: tuple[str, ...] = ()  # dtype values beyond DTYPES (e.g. gemm_plugin fp8)

    def choices(self) -> tuple[str, ...]:
        return DTYPES + self.extra


# Contract §4.1, "Plugin and feature flags" (1.x pydantic defaults). Order = the order flags are emitted.
FIELDS: tuple[Field, ...] = (
    Field("bert_attention_plugin", "dtype", "auto"),
    Field("gpt_attention_plugin", "dtype", "auto"),
    Field("gemm_plugin", "dtype", "disable", extra=("fp8", "nvfp4")),
    Field("gemm_swiglu_plugin", "dtype", "disable", extra=("fp8",)),
    Field("fp8_rowwise_gemm_plugin", "dtype", "disable"),
    Field("low_latency_gemm_plugin", "dtype", "disable", extra=("fp8",)),
    Field("low_latency_gemm_swiglu_plugin", "dtype", "disable", extra=("fp8",)),
    Field("gemm_allreduce_plugin", "dtype", "disable"),
    Field("lora_plugin", "dtype", "disable"),
    Field("dora_plugin", "bool", False),
    Field("moe_plugin", "dtype", "auto"),
    Field("mamba_conv1d_plugin", "dtype", "auto"),
    Field("nccl_plugin", "dtype", "auto"),
    Field("context_fmha", "bool", True),
    Field("bert_context_fmha_fp32_acc", "bool", False),
    Field("remove_input_padding", "bool", True),
    Field("tokens_per_block", "int", 32),
    Field("use_paged_context_fmha", "bool", True),
    Field("use_fp8_context_fmha", "bool", True),
    Field("fuse_fp4_quant", "bool", False),
    Field("multiple_profiles", "bool", False),
    Field("paged_state", "bool", True),
    Field("streamingllm", "bool", False),
    Field("norm_quant_fusion", "bool", False),
    Field("reduce_fusion", "bool", False),
    Field("user_buffer", "bool", False),
    Field("use_fused_mlp", "bool", True),
    Field("pp_reduce_scatter", "bool", False),
    # Not a trtllm-build flag: selects --kv_cache_type paged|continuous.
    Field("paged_kv_cache", "bool", True, cli=False),
)
BY_NAME = {f.name: f for f in FIELDS}


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    match: dict[str, list]
    plugins: dict[str, Any]  # normalized values (bools as bool, dtypes as str)
    path: Optional[Path] = field(default=None, compare=False)

    def matches(self, sm: int, quant_algo: Optional[str], kv_cache_quant_algo: Optional[str]) -> bool:
        facts = {"sm": sm, "quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}
        return all(facts[k] in allowed for k, allowed in self.match.items())


def normalize(name: str, value: Any, where: str) -> Any:
    """A field value in its one internal spelling; EngineError naming ``where`` when it is not allowed."""
    f = BY_NAME.get(name)
    if f is None:
        close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else " (see plugins/README.md for the fields)"
        raise EngineError(f"{where}: unknown plugin field '{name}'{hint}")
    if f.kind == "bool":
        if isinstance(value, bool):
            return value
        if value in ("enable", "disable"):
            return value == "enable"
        raise EngineError(f"{where}: {name} must be true/false (or enable/disable), got {value!r}")
    if f.kind == "int":
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and not value & (value - 1):
            return value
        raise EngineError(f"{where}: {name} must be a positive power of two, got {value!r}")
    if value is None or value is False:
        return "disable"
    if isinstance(value, str) and value in f.choices():
        return value
    raise EngineError(f"{where}: {name} must be one of {', '.join(f.choices())}, got {value!r}")


def preset_dir() -> Path:
    """``plugins/`` (``TRTPIPE_PLUGINS_DIR`` overrides it; see :mod:`trtpipe.resources`)."""
    from trtpipe.resources import data_dir

    return data_dir("plugins")


_MATCH_KEYS = ("sm", "quant_algo", "kv_cache_quant_algo")


def _read_preset(path: Path) -> Preset:
    where = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise EngineError(f"{where}: invalid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or set(data) - {"description", "match", "plugins"}:
        raise EngineError(f"{where}: a preset is a mapping with description, match and plugins only")
    match = data.get("match") or {}
    bad = set(match) - set(_MATCH_KEYS)
    if bad:
        raise EngineError(f"{where}: match: unknown key(s) {', '.join(sorted(bad))} (allowed: {', '.join(_MATCH_KEYS)})")
    plugins = {k: normalize(k, v, f"{where}: plugins.{k}") for k, v in (data.get("plugins") or {}).items()}
    return Preset(path.stem, str(data.get("description", "")), {k: list(v) for k, v in match.items()}, plugins, path)


@lru_cache(maxsize=4)
def _load_all(directory: str) -> tuple[Preset, ...]:
    d = Path(directory)
    if not d.is_dir():
        raise EngineError(f"plugin preset directory not found: {d}")
    return tuple(_read_preset(p) for p in sorted(d.glob("*.yaml")))


def all_presets() -> dict[str, Preset]:
    return {p.name: p for p in _load_all(str(preset_dir()))}


def get_preset(name: str) -> Preset:
    presets = all_presets()
    if name in presets:
        return presets[name]
    close = difflib.get_close_matches(name, list(presets), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f" (available: {', '.join(presets)})"
    raise EngineError(f"engine.plugins.preset: unknown preset '{name}'{hint}")


def auto_preset(sm: int, quant_algo: Optional[str], kv_cache_quant_algo: Optional[str]) -> Preset:
    """The first preset (by name) whose match fits; an error naming the combination when none does."""
    for p in all_presets().values():
        if p.matches(sm, quant_algo, kv_cache_quant_algo):
            return p
    raise EngineError(
        f"engine.plugins.preset: no preset in {preset_dir()} matches SM {sm}, quant_algo {quant_algo}, "
        f"kv_cache_quant_algo {kv_cache_quant_algo}; name one explicitly"
    )
