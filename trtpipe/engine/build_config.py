"""The engine build configuration: one frozen dataclass from (recipe, checkpoint config, preset), two spellings.

:func:`resolve_build` is pure: it picks the preset, applies the recipe's overrides and the builder's own
rewrites (:mod:`trtpipe.engine.enforce`), resolves the shape limits as ``trtllm-build`` does (max_seq_len
deduction, max_input_len clipping, max_num_tokens), and records every rewrite with its reason.
Reference: docs/reference/trtllm-build.md (builder-enforced combinations, max_num_tokens, output directory).
:func:`to_argv` and :func:`to_json` are the only serializers: the ``trtllm-build`` command line (every flag in
the 1.2.x CLI) and the equivalent ``build_config`` JSON (every BuildConfig field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from trtpipe.engine import ckptconfig, upstream
from trtpipe.engine.enforce import Change, Target, enforce, rejections
from trtpipe.formats.gpus import GPU, get_gpu
from trtpipe.formats.schemes import quant_algos
from trtpipe.engine.presets import BY_NAME, FIELDS, auto_preset, get_preset, normalize
from trtpipe.errors import EngineError
from trtpipe.models.dims import checkpoint_dims
from trtpipe.recipe.lookahead import draft_len
from trtpipe.recipe.schema import Recipe

if TYPE_CHECKING:
    from trtpipe.engine.lora_build import LoraBuild

TARGET_TRTLLM_VERSION = "1.2.1"  # the TensorRT-engine path this build config is written for (trtllm-build.md#versions)
OPT_NUM_TOKENS_WARN = 16384
SQ_PLUGIN_ALGOS = (
    "W8A8_SQ_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
)
WEIGHT_ONLY_PER_CHANNEL = ("W8A16", "W4A16")
WEIGHT_ONLY_GROUPWISE = quant_algos(lambda s: s.groupwise)  # the scheme table's group-wise rows


@dataclass(frozen=True)
class BuildConfig:
    """The BuildConfig fields trtpipe sets; the rest keep the builder's defaults (see :func:`to_json`)."""

    dtype: str
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    max_num_tokens: int
    opt_num_tokens: Optional[int]
    plugins: Mapping[str, Any]  # every FIELDS entry, after enforcement, in its CLI spelling
    world_size: int = 1
    quant_algo: Optional[str] = None
    kv_cache_quant_algo: Optional[str] = None
    disable_weight_only_quant_plugin: bool = False  # the checkpoint config's flag (Llama family)
    speculative_decoding_mode: Optional[str] = None  # trtllm-build's spelling (recipe speculative.decoding_type)
    max_draft_len: int = 0
    lora: Optional["LoraBuild"] = None  # the LoRA adapters built in (trtpipe.engine.lora_build)

    @property
    def kv_cache_type(self) -> str:
        return "PAGED" if self.plugins["paged_kv_cache"] else "CONTINUOUS"


@dataclass(frozen=True)
class EngineBuild:
    """A resolved build: the config, where each plugin value came from, and what was rewritten and why."""

    config: BuildConfig
    preset: str
    preset_is_auto: bool
    gpu: GPU
    target: Target
    workers: int
    sources: Mapping[
        str, str
    ]  # field -> "preset NAME" | "engine.plugins.overrides.F" | "engine.kv_cache.tokens_per_block"
    changes: tuple[Change, ...]  # every value rewritten by the builder's rules (applied here)
    rejected: tuple[tuple[str, str], ...]  # (field or recipe key, reason): the builder would raise
    explicit: frozenset[str] = field(default_factory=frozenset)  # engine.* shape keys the recipe wrote

    def emitted_fields(self) -> list[str]:
        """Plugin flags on the command line: every field the preset/recipe set or the rules rewrote."""
        named = set(self.sources) | {c.field for c in self.changes}
        return [f.name for f in FIELDS if f.cli and f.name in named]


def builder_target(cfg: dict, gpu: GPU) -> Target:
    """What trtllm-build's enforcement checks are keyed by (GPU sm, architecture, quant algos, tp, pp) for the
    checkpoint config ``cfg`` on ``gpu``; the validation rules ask it before resolving a build."""
    qa, kv = ckptconfig.quant(cfg)
    tp, pp = ckptconfig.mapping(cfg)
    group = (cfg.get("quantization") or {}).get("group_size")
    return Target(
        sm=gpu.sm,
        architecture=cfg["architecture"],
        quant_algo=qa,
        kv_cache_quant_algo=kv,
        tp=tp,
        pp=pp,
        group_size=int(group) if group else None,
    )


def _plugins(recipe: Recipe, target: Target) -> tuple[str, bool, dict[str, Any], dict[str, str]]:
    """Builder defaults <- preset <- recipe overrides <- an explicit engine.kv_cache.tokens_per_block."""
    name = recipe.engine.plugins.preset
    preset = (
        auto_preset(target.sm, target.quant_algo, target.kv_cache_quant_algo) if name == "auto" else get_preset(name)
    )
    values = {f.name: f.default for f in FIELDS}
    sources: dict[str, str] = {}
    for k, v in preset.plugins.items():
        values[k], sources[k] = v, f"preset {preset.name}"
    for k, v in recipe.engine.plugins.overrides.items():
        values[k] = normalize(k, v, f"engine.plugins.overrides.{k}")
        sources[k] = f"engine.plugins.overrides.{k}"
    kv = recipe.engine.kv_cache
    if "tokens_per_block" in kv.model_fields_set or "tokens_per_block" not in sources:
        values["tokens_per_block"], sources["tokens_per_block"] = (
            kv.tokens_per_block,
            "engine.kv_cache.tokens_per_block",
        )
    return preset.name, name == "auto", values, sources


def resolve_limits(recipe: Recipe, cfg: dict, plugins: Mapping[str, Any]) -> tuple[dict[str, int], list[Change]]:
    """max_seq_len / max_input_len / max_num_tokens / opt_num_tokens exactly as trtllm-build resolves them."""
    e = recipe.engine
    changes: list[Change] = []
    seq = e.max_seq_len or ckptconfig.deduced_max_seq_len(cfg)
    inp = e.max_input_len
    if inp > seq:
        changes.append(Change("max_input_len", inp, seq, f"clipped to max_seq_len {seq}"))
        inp = seq
    batch, beam = e.max_batch_size, e.max_beam_width
    tokens = e.max_num_tokens
    opt: Optional[int] = None
    if not plugins["remove_input_padding"]:
        if tokens != batch * seq:
            changes.append(
                Change(
                    "max_num_tokens",
                    tokens,
                    batch * seq,
                    "without remove_input_padding it is max_batch_size x max_seq_len",
                )
            )
        tokens = batch * seq
        return {"max_seq_len": seq, "max_input_len": inp, "max_num_tokens": tokens, "opt_num_tokens": None}, changes
    if not plugins["multiple_profiles"]:  # computed before max_num_tokens is clamped or raised
        opt = min(batch * beam, tokens)
    if tokens > batch * seq:
        changes.append(
            Change("max_num_tokens", tokens, batch * seq, f"clamped to max_batch_size x max_seq_len = {batch * seq}")
        )
        tokens = batch * seq
    if not plugins["context_fmha"] and tokens < inp:
        changes.append(Change("max_num_tokens", tokens, inp, "raised to max_input_len (context_fmha is off)"))
        tokens = inp
    elif plugins["context_fmha"] and tokens < plugins["tokens_per_block"]:
        changes.append(Change("max_num_tokens", tokens, plugins["tokens_per_block"], "raised to tokens_per_block"))
        tokens = plugins["tokens_per_block"]
    if opt is not None and opt > tokens:
        opt = tokens
    return {"max_seq_len": seq, "max_input_len": inp, "max_num_tokens": tokens, "opt_num_tokens": opt}, changes


def resolve_build(
    recipe: Recipe, checkpoint_config: dict, gpu: Optional[GPU] = None, lora: Optional["LoraBuild"] = None
) -> EngineBuild:
    """The whole build from the recipe and the checkpoint's config.json (or its prediction). Pure. ``lora``: the
    adapters to build in (:func:`trtpipe.engine.lora_build.lora_build`), which turns ``lora_plugin`` on (``auto``:
    the model dtype) unless the recipe's overrides name its dtype.

    Raises:
        EngineError: unknown GPU, preset or plugin field, or a value a field does not take.
    """
    gpu = gpu or get_gpu(recipe.engine.gpu)
    target = builder_target(checkpoint_config, gpu)
    preset, is_auto, values, sources = _plugins(recipe, target)
    if lora is not None and values.get("lora_plugin") in (None, "disable"):
        values["lora_plugin"], sources["lora_plugin"] = "auto", "lora.adapters"
    values, changes = enforce(values, target, explicit=set(sources))
    rejected = rejections(values, target)
    limits, limit_changes = resolve_limits(recipe, checkpoint_config, values)
    tp, pp = target.tp, target.pp
    config = BuildConfig(
        dtype=checkpoint_config["dtype"],
        max_batch_size=recipe.engine.max_batch_size,
        max_beam_width=recipe.engine.max_beam_width,
        plugins=values,
        world_size=tp * pp,
        quant_algo=target.quant_algo,
        kv_cache_quant_algo=target.kv_cache_quant_algo,
        disable_weight_only_quant_plugin=bool(checkpoint_config.get("disable_weight_only_quant_plugin", False)),
        **_speculative(recipe),
        **limits,
        lora=lora,
    )
    return EngineBuild(
        config=config,
        preset=preset,
        preset_is_auto=is_auto,
        gpu=gpu,
        target=target,
        workers=recipe.engine.workers,
        sources=sources,
        changes=tuple(changes + limit_changes),
        rejected=tuple(rejected),
        explicit=frozenset(recipe.engine.model_fields_set),
    )


# SpeculativeDecodingMode (an IntFlag of auto() members: NONE 1, DRAFT_TOKENS_EXTERNAL 2, MEDUSA 4,
# LOOKAHEAD_DECODING 8, EXPLICIT_DRAFT_TOKENS 16, EAGLE 32), tensorrt_llm/models/modeling_utils.py (commit not recorded)
SPECULATIVE_MODE_VALUES = {
    None: 1,
    "draft_tokens_external": 2,
    "medusa": 4,
    "lookahead_decoding": 8,
    "explicit_draft_tokens": 16,
    "eagle": 32,
}


def _speculative(recipe: Recipe) -> dict[str, Any]:
    """The engine's speculative mode and draft length (the llmapi target's speculation is not built in)."""
    s = recipe.speculative
    if recipe.target != "engine" or s.decoding_type not in SPECULATIVE_MODE_VALUES:
        return {}
    # lookahead_decoding: D = (N - 2) + (W - 1 + G) * (N - 1), the layer's maxTokensPerStep - 1 (recipe/lookahead.py)
    return {"speculative_decoding_mode": s.decoding_type, "max_draft_len": draft_len(recipe)}


def _cli_value(name: str, value: Any) -> str:
    if BY_NAME[name].kind == "bool":
        return "enable" if value else "disable"
    return str(value)


def _flags(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(``--flag``, its values) of a command line (a flag takes every value up to the next ``--flag``)."""
    out: list[tuple[str, list[str]]] = []
    for tok in argv[1:]:
        if tok.startswith("--"):
            out.append((tok, []))
        elif not out:
            raise EngineError(f"trtllm-build: {tok!r} follows no flag")
        else:
            out[-1][1].append(tok)
    return out


def check_argv(argv: list[str]) -> None:
    """Every ``--flag value`` of a trtllm-build command is a flag of the targeted version, with a value its
    argparse accepts (the upstream table); ``nargs="+"`` flags take one or more. Raises EngineError naming the
    flag and the allowed values."""
    for flag, values in _flags(argv):
        name = flag[2:]
        plugin = upstream.PLUGIN_BY_NAME.get(name)
        general = upstream.BUILD_FLAG_BY_NAME.get(name)
        if plugin is not None and plugin.cli:
            kind, choices, fold, nargs = plugin.kind, plugin.choices(), False, False
        elif general is not None:
            kind, choices, fold, nargs = general.kind, general.choices, general.case_insensitive, general.nargs
        else:
            raise EngineError(f"trtllm-build has no flag {flag} in TensorRT-LLM {TARGET_TRTLLM_VERSION}")
        if not values or (len(values) > 1 and not nargs):
            raise EngineError(f"trtllm-build {flag}: takes {'one or more values' if nargs else 'one value'}")
        for value in values:
            if kind == "int":
                if not value.lstrip("-").isdigit():
                    raise EngineError(f"trtllm-build {flag}: {value!r} is not an integer")
            elif choices and (value.lower() if fold else value) not in choices:
                raise EngineError(f"trtllm-build {flag}: {value!r} is not accepted (allowed: {', '.join(choices)})")


def to_argv(
    build: EngineBuild, checkpoint_dir: str | Path, output_dir: str | Path, build_config_json: str | Path | None = None
) -> list[str]:
    """The ``trtllm-build`` command, checked value by value against the upstream flag table.

    With ``build_config_json`` the shape flags are replaced by ``--build_config``. The plugin flags are still
    given: the JSON's ``plugin_config`` overrides every one of them (``BuildConfig.from_dict`` overlays it), but
    ``--gemm_plugin disable`` on the command line is what keeps an NVFP4 model off the NVFP4 GEMM plugin."""
    c = build.config
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(output_dir)]
    if build_config_json is not None:
        argv += ["--build_config", str(build_config_json)]
    else:
        argv += [
            "--max_batch_size",
            str(c.max_batch_size),
            "--max_input_len",
            str(c.max_input_len),
            "--max_seq_len",
            str(c.max_seq_len),
            "--max_beam_width",
            str(c.max_beam_width),
            "--max_num_tokens",
            str(c.max_num_tokens),
            "--kv_cache_type",
            c.kv_cache_type.lower(),
        ]
    for name in build.emitted_fields():
        argv += [f"--{name}", _cli_value(name, c.plugins[name])]
    if c.lora is not None:  # --lora_plugin is among the plugin flags above
        argv += c.lora.argv()
    if c.speculative_decoding_mode:
        argv += ["--speculative_decoding_mode", c.speculative_decoding_mode, "--max_draft_len", str(c.max_draft_len)]
    argv += ["--workers", str(build.workers)]
    check_argv(argv)
    return argv


def _stored(value: Any) -> Optional[str]:
    """A dtype field as PluginConfig stores it: "disable" is None, anything else (``auto`` included) literally.
    PluginConfig resolves ``auto`` to its dtype only on attribute access; model_dump writes the stored value."""
    return None if value == "disable" else value


def plugin_config_json(c: BuildConfig) -> dict[str, Any]:
    """``build_config.plugin_config`` as 1.2's ``Engine.save`` writes it (``PluginConfig.model_dump()``).

    Every field of the upstream table in its declaration order: CLI fields from the final (enforced) values,
    the builder-set fields as ``builder.build`` sets them from the model's quantization and mapping.
    """
    out: dict[str, Any] = {}
    for f in upstream.PLUGIN_CONFIG:
        if f.cli:
            v = c.plugins[f.name]
            out[f.name] = _stored(v) if f.kind == "dtype" else v
        else:
            out[f.name] = f.default
    out["dtype"] = c.dtype  # builder.build: plugin_config.dtype = model dtype
    out["paged_kv_cache"] = bool(c.plugins["paged_kv_cache"])  # update_kv_cache_type, from kv_cache_type
    qa = c.quant_algo
    if not c.disable_weight_only_quant_plugin:
        if qa in WEIGHT_ONLY_GROUPWISE:
            out["weight_only_groupwise_quant_matmul_plugin"] = c.dtype
        elif qa in WEIGHT_ONLY_PER_CHANNEL:
            out["weight_only_quant_matmul_plugin"] = c.dtype
    if qa in SQ_PLUGIN_ALGOS and out["smooth_quant_plugins"]:  # set_smooth_quant_plugins(dtype)
        for name in ("smooth_quant_gemm_plugin", "rmsnorm_quantization_plugin", "layernorm_quantization_plugin"):
            out[name] = c.dtype
        out["quantize_per_token_plugin"] = out["quantize_tensor_plugin"] = True
    rowwise_algos, _ = upstream.FP8_ROWWISE_ALGOS
    if qa in rowwise_algos:  # set_fp8_rowwise_quant_plugins(dtype), whatever the command line said
        for name, value in upstream.FP8_ROWWISE_SETS[0]:
            out[name] = c.dtype if value == "dtype" else value
    out["nccl_plugin"] = c.dtype if c.world_size > 1 else None  # set_nccl_plugin(dtype or None)
    return out


def to_json(c: BuildConfig) -> dict[str, Any]:
    """The ``build_config`` object of the engine's config.json (and of ``trtllm-build --build_config``)."""
    strongly_typed = True  # the 1.x default; FP8 weights or FP8 KV force it anyway
    return {
        "max_input_len": c.max_input_len,
        "max_seq_len": c.max_seq_len,
        "opt_batch_size": 8,
        "max_batch_size": c.max_batch_size,
        "max_beam_width": c.max_beam_width,
        "max_num_tokens": c.max_num_tokens,
        "opt_num_tokens": c.opt_num_tokens,
        "max_prompt_embedding_table_size": 0,
        "kv_cache_type": c.kv_cache_type,
        "gather_context_logits": False,
        "gather_generation_logits": False,
        "strongly_typed": strongly_typed,
        "force_num_profiles": None,
        "profiling_verbosity": "layer_names_only",
        "enable_debug_output": False,
        "max_draft_len": c.max_draft_len,
        "speculative_decoding_mode": SPECULATIVE_MODE_VALUES[c.speculative_decoding_mode],  # an IntFlag, as an int
        "use_refit": False,
        "input_timing_cache": None,
        "output_timing_cache": "model.cache",
        "lora_config": {
            **{name: json.loads(json.dumps(default)) for name, default, _ in upstream.LORA_CONFIG},
            **(c.lora.config_json() if c.lora is not None else {}),
        },
        "weight_sparsity": False,
        "weight_streaming": False,
        "plugin_config": plugin_config_json(c),
        "use_strip_plan": False,
        "max_encoder_input_len": 1024,
        "monitor_memory": False,
        "use_mrope": False,
    }


def engine_config_json(checkpoint_config: dict, c: BuildConfig, version: str = TARGET_TRTLLM_VERSION) -> dict:
    """The engine directory's ``config.json``: version, pretrained_config (mapping without rank), build_config."""
    pretrained = dict(checkpoint_config)
    mapping = dict(pretrained.get("mapping") or {})
    mapping.pop("rank", None)
    tp, pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
    for k, v in (("world_size", tp * pp), ("gpus_per_node", 8), ("cp_size", 1), ("tp_size", tp), ("pp_size", pp)):
        mapping.setdefault(k, v)
    pretrained["mapping"] = mapping
    d = checkpoint_dims(pretrained)  # TensorRT-LLM's PretrainedConfig defaults for the sizes the file omits
    for k, v in (
        ("logits_dtype", "float32"),
        ("norm_epsilon", d.rms_norm_eps),
        ("num_key_value_heads", d.num_kv_heads),
        ("head_size", d.head_dim),
        ("intermediate_size", d.intermediate_size),
    ):
        pretrained.setdefault(k, v)
    return {"version": version, "pretrained_config": pretrained, "build_config": to_json(c)}


def findings(build: EngineBuild) -> list[tuple[str, str]]:
    """What the recipe asked for that the builder would change or reject, as (recipe key, message).

    A rewrite of a value the recipe (or a preset it named) chose is reported; with ``preset: auto`` the
    preset's own values are adjusted silently-but-explicitly (trtpipe emits the final values) and only the
    recipe's overrides are reported. Shape limits are reported only when the recipe wrote them.
    """
    out: list[tuple[str, str]] = []
    for ch in build.changes:
        src = build.sources.get(ch.field)
        if ch.field in BY_NAME:
            if src is None or (build.preset_is_auto and src.startswith("preset ")):
                continue
            key = "engine.plugins.preset" if src.startswith("preset ") else src
            out.append((key, f"{ch.field} would be changed by trtllm-build: {ch} (from {src})"))
        elif ch.field in build.explicit:
            out.append((f"engine.{ch.field}", f"trtllm-build would change it: {ch}"))
    for key, reason in build.rejected:
        if key in BY_NAME:
            src = build.sources.get(key, "the builder default")
            key = (
                "engine.plugins.preset"
                if src.startswith("preset ")
                else src
                if src.startswith("engine.")
                else "engine.plugins"
            )
        out.append((key, f"trtllm-build rejects this: {reason}"))
    return out
