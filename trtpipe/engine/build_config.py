"""The engine build configuration: one frozen dataclass from (recipe, checkpoint config, preset), two spellings.

:func:`resolve_build` is pure: it picks the preset, applies the recipe's overrides and the builder's own
rewrites (contract §4.2, :mod:`trtpipe.engine.enforce`), resolves the shape limits as ``trtllm-build`` does
(max_seq_len deduction, max_input_len clipping, §4.3 max_num_tokens), and records every rewrite with its reason.
:func:`to_argv` and :func:`to_json` are the only serializers: the ``trtllm-build`` command line (every flag in
the 1.2.x CLI, §4.1) and the equivalent ``build_config`` JSON (every BuildConfig field, §4.4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from trtpipe.engine import ckptconfig
from trtpipe.engine.enforce import Change, Target, enforce, rejections
from trtpipe.engine.gpus import GPU, get_gpu
from trtpipe.engine.presets import BY_NAME, FIELDS, auto_preset, get_preset, normalize
from trtpipe.recipe.schema import Recipe

TARGET_TRTLLM_VERSION = "1.2.1"  # contract §0: the TensorRT-engine path this build config is written for
OPT_NUM_TOKENS_WARN = 16384
SQ_PLUGIN_ALGOS = (
    "W8A8_SQ_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
    "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
    "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
)
WEIGHT_ONLY_PER_CHANNEL = ("W8A16", "W4A16")
WEIGHT_ONLY_GROUPWISE = ("W4A16_AWQ", "W4A8_AWQ", "W4A16_GPTQ", "W8A16_GPTQ")


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
    sources: Mapping[str, str]  # field -> "preset NAME" | "engine.plugins.overrides.F" | "engine.kv_cache.tokens_per_block"
    changes: tuple[Change, ...]  # every value rewritten by the builder's rules (applied here)
    rejected: tuple[tuple[str, str], ...]  # (field or recipe key, reason): the builder would raise
    explicit: frozenset[str] = field(default_factory=frozenset)  # engine.* shape keys the recipe wrote

    def emitted_fields(self) -> list[str]:
        """Plugin flags on the command line: every field the preset/recipe set or the rules rewrote."""
        named = set(self.sources) | {c.field for c in self.changes}
        return [f.name for f in FIELDS if f.cli and f.name in named]


def _target(cfg: dict, gpu: GPU) -> Target:
    qa, kv = ckptconfig.quant(cfg)
    tp, pp = ckptconfig.mapping(cfg)
    return Target(sm=gpu.sm, architecture=cfg["architecture"], quant_algo=qa, kv_cache_quant_algo=kv, tp=tp, pp=pp)


def _plugins(recipe: Recipe, target: Target) -> tuple[str, bool, dict[str, Any], dict[str, str]]:
    """Builder defaults <- preset <- recipe overrides <- an explicit engine.kv_cache.tokens_per_block."""
    name = recipe.engine.plugins.preset
    preset = auto_preset(target.sm, target.quant_algo, target.kv_cache_quant_algo) if name == "auto" else get_preset(name)
    values = {f.name: f.default for f in FIELDS}
    sources: dict[str, str] = {}
    for k, v in preset.plugins.items():
        values[k], sources[k] = v, f"preset {preset.name}"
    for k, v in recipe.engine.plugins.overrides.items():
        values[k] = normalize(k, v, f"engine.plugins.overrides.{k}")
        sources[k] = f"engine.plugins.overrides.{k}"
    kv = recipe.engine.kv_cache
    if "tokens_per_block" in kv.model_fields_set or "tokens_per_block" not in sources:
        values["tokens_per_block"], sources["tokens_per_block"] = kv.tokens_per_block, "engine.kv_cache.tokens_per_block"
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
            changes.append(Change("max_num_tokens", tokens, batch * seq, "without remove_input_padding it is max_batch_size x max_seq_len"))
        tokens = batch * seq
        return {"max_seq_len": seq, "max_input_len": inp, "max_num_tokens": tokens, "opt_num_tokens": None}, changes
    if tokens > batch * seq:
        changes.append(Change("max_num_tokens", tokens, batch * seq, f"clamped to max_batch_size x max_seq_len = {batch * seq}"))
        tokens = batch * seq
    if not plugins["context_fmha"] and tokens < inp:
        changes.append(Change("max_num_tokens", tokens, inp, "raised to max_input_len (context_fmha is off)"))
        tokens = inp
    elif plugins["context_fmha"] and tokens < plugins["tokens_per_block"]:
        changes.append(Change("max_num_tokens", tokens, plugins["tokens_per_block"], "raised to tokens_per_block"))
        tokens = plugins["tokens_per_block"]
    if not plugins["multiple_profiles"]:
        opt = min(batch * beam, tokens)
    return {"max_seq_len": seq, "max_input_len": inp, "max_num_tokens": tokens, "opt_num_tokens": opt}, changes


def resolve_build(recipe: Recipe, checkpoint_config: dict, gpu: Optional[GPU] = None) -> EngineBuild:
    """The whole build from the recipe and the checkpoint's config.json (or its prediction). Pure.

    Raises:
        EngineError: unknown GPU, preset or plugin field, or a value a field does not take.
    """
    gpu = gpu or get_gpu(recipe.engine.gpu)
    target = _target(checkpoint_config, gpu)
    preset, is_auto, values, sources = _plugins(recipe, target)
    values, changes = enforce(values, target)
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
        **limits,
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


def _cli_value(name: str, value: Any) -> str:
    if BY_NAME[name].kind == "bool":
        return "enable" if value else "disable"
    return str(value)


def to_argv(build: EngineBuild, checkpoint_dir: str | Path, output_dir: str | Path,
            build_config_json: str | Path | None = None) -> list[str]:
    """The ``trtllm-build`` command. With ``build_config_json`` the shape flags are replaced by
    ``--build_config`` (the builder ignores them then) while plugin flags are still given, as it still applies them."""
    c = build.config
    argv = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(output_dir)]
    if build_config_json is not None:
        argv += ["--build_config", str(build_config_json)]
    else:
        argv += [
            "--max_batch_size", str(c.max_batch_size),
            "--max_input_len", str(c.max_input_len),
            "--max_seq_len", str(c.max_seq_len),
            "--max_beam_width", str(c.max_beam_width),
            "--max_num_tokens", str(c.max_num_tokens),
            "--kv_cache_type", c.kv_cache_type.lower(),
        ]
    for name in build.emitted_fields():
        argv += [f"--{name}", _cli_value(name, c.plugins[name])]
    argv += ["--workers", str(build.workers)]
    return argv


def _dtype_field(value: str, dtype: str) -> Optional[str]:
    return None if value == "disable" else dtype if value == "auto" else value


def plugin_config_json(c: BuildConfig) -> dict[str, Any]:
    """PluginConfig as the builder serializes it: plugin fields as dtype strings or null, features as bools."""
    out: dict[str, Any] = {"dtype": c.dtype}
    for f in FIELDS:
        v = c.plugins[f.name]
        out[f.name] = _dtype_field(v, c.dtype) if f.kind == "dtype" else v
    # Set by the builder itself, never by a flag (contract §4.1, "Non-CLI PluginConfig fields").
    out["nccl_plugin"] = c.dtype if c.world_size > 1 else None
    qa = c.quant_algo
    out["weight_only_quant_matmul_plugin"] = c.dtype if qa in WEIGHT_ONLY_PER_CHANNEL else None
    out["weight_only_groupwise_quant_matmul_plugin"] = c.dtype if qa in WEIGHT_ONLY_GROUPWISE else None
    sq = qa in SQ_PLUGIN_ALGOS
    out["smooth_quant_plugins"] = True
    for name in ("smooth_quant_gemm_plugin", "rmsnorm_quantization_plugin", "layernorm_quantization_plugin"):
        out[name] = c.dtype if sq else None
    out["quantize_per_token_plugin"] = sq
    out["quantize_tensor_plugin"] = sq
    if qa == "FP8_PER_CHANNEL_PER_TOKEN" and out["fp8_rowwise_gemm_plugin"] is None:
        out["fp8_rowwise_gemm_plugin"] = c.dtype
    if qa == "NVFP4" and c.plugins["gemm_plugin"] == "auto":
        out["gemm_plugin"] = "nvfp4"
    out["qserve_gemm_plugin"] = None
    out["identity_plugin"] = None
    out["manage_weights"] = False
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
        "max_draft_len": 0,
        "speculative_decoding_mode": 1,  # SpeculativeDecodingMode.NONE (an IntFlag, serialized as an int)
        "use_refit": False,
        "input_timing_cache": None,
        "output_timing_cache": "model.cache",
        "lora_config": {
            "lora_dir": [],
            "lora_ckpt_source": "hf",
            "max_lora_rank": 64,
            "lora_target_modules": [],
            "trtllm_modules_to_hf_modules": {},
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
    for k, v in (("logits_dtype", "float32"), ("norm_epsilon", 1e-5),
                 ("num_key_value_heads", pretrained["num_attention_heads"]),
                 ("head_size", pretrained["hidden_size"] // pretrained["num_attention_heads"]),
                 ("intermediate_size", 4 * pretrained["hidden_size"])):
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
            key = "engine.plugins.preset" if src.startswith("preset ") else src if src.startswith("engine.") else "engine.plugins"
        out.append((key, f"trtllm-build rejects this: {reason}"))
    return out
