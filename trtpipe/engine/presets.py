"""Plugin presets: declarative PluginConfig settings per GPU architecture and precision (``plugins/*.yaml``).

A preset file::

    description: Hopper (SM 9.0), FP8 weights and activations with an FP8 KV cache
    match: {sm: [90], quant_algo: [FP8], kv_cache_quant_algo: [FP8, null]}
    plugins: {gpt_attention_plugin: auto, gemm_plugin: fp8, use_fp8_context_fmha: true, ...}

``plugins`` may only name fields of :data:`FIELDS` (the PluginConfig fields ``trtllm-build`` exposes on its
command line, from :mod:`trtpipe.engine.upstream`, plus ``paged_kv_cache``, which is emitted as ``--kv_cache_type``). A recipe names a
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

from trtpipe.engine import upstream
from trtpipe.errors import EngineError


@dataclass(frozen=True)
class Field:
    """One PluginConfig field a preset or recipe may set: its kind, its default when trtllm-build is not given
    the flag (in the CLI spelling: dtype off = "disable"), its allowed values, and whether it is a CLI flag."""

    name: str
    kind: str  # "dtype" (a plugin: dtype string or disable), "bool" (enable/disable feature), "int"
    default: Any
    cli: bool = True
    allowed: tuple[str, ...] = ()  # dtype fields: the argparse choices (upstream table), "disable" included
    source: str = ""

    def choices(self) -> tuple[str, ...]:
        return self.allowed


def _field(f: upstream.PluginField) -> Field:
    return Field(f.name, f.kind, upstream.cli_default(f), True, f.choices() if f.kind == "dtype" else (), f.source)


# The PluginConfig fields trtllm-build exposes (cli_plugin_args), in upstream's declaration order, with the values
# upstream's argparse accepts (trtpipe/engine/upstream.py). Order = the order flags are emitted.
FIELDS: tuple[Field, ...] = tuple(_field(f) for f in upstream.PLUGIN_CONFIG if f.cli) + (
    # Not a trtllm-build flag: selects --kv_cache_type paged|continuous.
    Field("paged_kv_cache", "bool", True, cli=False, source=upstream.BUILD_PY),
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
    raise EngineError(
        f"{where}: {name} must be one of {', '.join(f.choices())} (trtllm-build's choices), got {value!r}"
    )


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
        raise EngineError(
            f"{where}: match: unknown key(s) {', '.join(sorted(bad))} (allowed: {', '.join(_MATCH_KEYS)})"
        )
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
