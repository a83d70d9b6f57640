"""What TensorRT-LLM's own source says about ``trtllm-build`` and the engine ``config.json``, kept as data.

Every row names the upstream file and commit it was read from (the version trtpipe targets, 1.1/1.2). trtpipe
validates recipes against these tables, emits only values they allow, and predicts the engine ``config.json``
from them; the tests compare what trtpipe emits with these rows instead of restating the facts. Moving to a
new TensorRT-LLM version is an edit of this file: change the rows (and their sources), run the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from trtpipe.formats.schemes import FINEGRAINED_SOURCE, SCHEMES

# Upstream files, as file@commit (NVIDIA/TensorRT-LLM).
PLUGIN_PY = "tensorrt_llm/plugin/plugin.py@c20322ff"
BUILD_PY = "tensorrt_llm/commands/build.py@65f1d153"
BUILDER_PY = "tensorrt_llm/builder.py (1.1/1.2: imports lora_helper, no auto_parallel_config; commit not recorded)"
LORA_HELPER_PY = "tensorrt_llm/lora_helper.py@585c7565"
COMMON_PY = "tensorrt_llm/_common.py check_max_num_tokens (1.1/1.2)"
KV_CACHE_TYPE_H = "cpp/include/tensorrt_llm/runtime/modelConfig.h KVCacheTypeFromString (upper-cases its argument)"

# ``DefaultPluginDtype`` without its ``None`` (plugin.py): the dtypes most plugin fields take.
DEFAULT_PLUGIN_DTYPES = ("auto", "float16", "float32", "bfloat16", "int32")


@dataclass(frozen=True)
class PluginField:
    """One ``PluginConfig`` field: how it is declared, its default, and whether ``trtllm-build`` exposes it.

    ``values`` are a dtype field's ``Literal`` members (``None``, i.e. off, is spelled ``disable`` on the CLI);
    ``default`` is the pydantic default as ``model_dump`` writes it (``None`` = off).
    """

    name: str
    kind: str  # "dtype" (Optional[Literal[...]]), "bool", "optional_bool", "int", "str"
    default: Any
    values: tuple[str, ...] = ()
    cli: bool = False  # listed in cli_plugin_args, so a trtllm-build flag
    source: str = PLUGIN_PY

    def choices(self) -> tuple[str, ...]:
        """The flag's argparse ``choices`` (add_plugin_argument); empty for an int flag."""
        if self.kind == "dtype":
            return self.values + ("disable",)
        if self.kind == "bool":
            return ("enable", "disable")
        return ()


def _d(
    name: str, default: Optional[str], values: tuple[str, ...] = DEFAULT_PLUGIN_DTYPES, cli: bool = True
) -> PluginField:
    return PluginField(name, "dtype", default, values, cli)


def _b(name: str, default: bool, cli: bool = True) -> PluginField:
    return PluginField(name, "bool", default, (), cli)


# PluginConfig, in declaration order (the order model_dump, hence the engine config.json, writes the keys).
PLUGIN_CONFIG: tuple[PluginField, ...] = (
    PluginField("dtype", "str", "float16"),
    _d("bert_attention_plugin", "auto"),
    _d("gpt_attention_plugin", "auto"),
    _d("gemm_plugin", None, DEFAULT_PLUGIN_DTYPES + ("fp8", "nvfp4")),
    _d("gemm_swiglu_plugin", None, ("fp8",)),
    _d("fp8_rowwise_gemm_plugin", None),
    _d("qserve_gemm_plugin", None, cli=False),
    _d("identity_plugin", None, cli=False),
    _d("nccl_plugin", "auto"),
    _d("lora_plugin", None),
    _b("dora_plugin", False),
    _d("weight_only_groupwise_quant_matmul_plugin", None, cli=False),
    _d("weight_only_quant_matmul_plugin", None, cli=False),
    _b("smooth_quant_plugins", True, cli=False),
    _d("smooth_quant_gemm_plugin", None, cli=False),
    _d("layernorm_quantization_plugin", None, cli=False),
    _d("rmsnorm_quantization_plugin", None, cli=False),
    _b("quantize_per_token_plugin", False, cli=False),
    _b("quantize_tensor_plugin", False, cli=False),
    _d("moe_plugin", "auto"),
    _d("mamba_conv1d_plugin", "auto"),
    _d("low_latency_gemm_plugin", None, ("fp8",)),
    _d("low_latency_gemm_swiglu_plugin", None, ("fp8",)),
    _d("gemm_allreduce_plugin", None, ("float16", "bfloat16")),
    _b("context_fmha", True),
    _b("bert_context_fmha_fp32_acc", False),
    PluginField("paged_kv_cache", "optional_bool", None),  # set by the builder from kv_cache_type
    _b("remove_input_padding", True),
    _b("norm_quant_fusion", False),
    _b("reduce_fusion", False),
    _b("user_buffer", False),
    PluginField("tokens_per_block", "int", 32, cli=True),
    _b("use_paged_context_fmha", True),
    _b("use_fp8_context_fmha", True),
    _b("fuse_fp4_quant", False),
    _b("multiple_profiles", False),
    _b("paged_state", True),
    _b("streamingllm", False),
    _b("manage_weights", False, cli=False),
    _b("use_fused_mlp", True),
    _b("pp_reduce_scatter", False),
)
PLUGIN_BY_NAME = {f.name: f for f in PLUGIN_CONFIG}


@dataclass(frozen=True)
class BuildFlag:
    """A general ``trtllm-build`` flag: its type and, when argparse restricts it, the values it accepts."""

    name: str
    kind: str  # "int", "str", "choice"
    choices: tuple[str, ...] = ()
    case_insensitive: bool = False
    source: str = BUILD_PY
    nargs: bool = False  # argparse nargs="+": one or more values


BUILD_FLAGS: tuple[BuildFlag, ...] = (
    BuildFlag("checkpoint_dir", "str"),
    BuildFlag("model_config", "str"),
    BuildFlag("build_config", "str"),
    BuildFlag("output_dir", "str"),
    BuildFlag("max_batch_size", "int"),
    BuildFlag("max_input_len", "int"),
    BuildFlag("max_seq_len", "int"),
    BuildFlag("max_beam_width", "int"),
    BuildFlag("max_num_tokens", "int"),
    BuildFlag("opt_num_tokens", "int"),
    BuildFlag("max_encoder_input_len", "int"),
    BuildFlag("max_prompt_embedding_table_size", "int"),
    BuildFlag(
        "kv_cache_type",
        "choice",
        ("continuous", "paged", "disabled"),
        True,
        f"{BUILD_PY} enum_type(KVCacheType) + {KV_CACHE_TYPE_H}",
    ),
    BuildFlag("input_timing_cache", "str"),
    BuildFlag("output_timing_cache", "str"),
    BuildFlag("profiling_verbosity", "choice", ("layer_names_only", "detailed", "none")),
    BuildFlag("workers", "int"),
    BuildFlag("logits_dtype", "choice", ("float16", "float32")),
    BuildFlag("lora_dir", "str", nargs=True),
    BuildFlag("lora_ckpt_source", "choice", ("hf", "nemo")),
    # choices=LoraManager.LORA_MODULE_IDS.keys() (tensorrt_llm/lora_manager.py): the dense decoder's ids 0-7 only, the
    # ones trtpipe emits (the table also has cross_attn_*, moe_*, mlp_router, mlp_gate_up, ...; not listed here)
    BuildFlag(
        "lora_target_modules",
        "choice",
        ("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"),
        nargs=True,
    ),
    BuildFlag("max_lora_rank", "int"),
    BuildFlag(
        "speculative_decoding_mode",
        "choice",
        ("draft_tokens_external", "lookahead_decoding", "medusa", "explicit_draft_tokens", "eagle"),
    ),
    BuildFlag("max_draft_len", "int"),
)
BUILD_FLAG_BY_NAME = {f.name: f for f in BUILD_FLAGS}

# LoraConfig fields in declaration order with their defaults: what model_dump writes when no LoRA is built.
LORA_CONFIG: tuple[tuple[str, Any, str], ...] = (
    ("lora_dir", [], LORA_HELPER_PY),
    ("lora_ckpt_source", "hf", LORA_HELPER_PY),
    ("max_lora_rank", 64, LORA_HELPER_PY),
    ("lora_target_modules", [], LORA_HELPER_PY),
    ("trtllm_modules_to_hf_modules", {}, LORA_HELPER_PY),
    ("max_loras", None, LORA_HELPER_PY),
    ("max_cpu_loras", None, LORA_HELPER_PY),
    ("swap_gate_up_proj_lora_b_weight", True, LORA_HELPER_PY),
)

# ---- builder behaviour (builder.build / BuildConfig / PluginConfig.validate), as data -----------------

# BuildConfig.update_kv_cache_type: these architectures keep their paged state in ``paged_state``; for every
# other one the builder sets ``paged_kv_cache`` from kv_cache_type and forces ``paged_state`` to False.
PAGED_STATE_ARCHITECTURES = (("MambaForCausalLM", "RecurrentGemmaForCausalLM"), BUILDER_PY)
# PluginConfig.validate: plugins rejected on one exact SM version (``sm in unsupported_plugins``).
VALIDATE_REJECTS_BY_SM: tuple[dict[int, tuple[str, ...]], str] = (
    {
        100: (
            "gemm_swiglu_plugin",
            "fp8_rowwise_gemm_plugin",
            "low_latency_gemm_plugin",
            "low_latency_gemm_swiglu_plugin",
            "bert_context_fmha_fp32_acc",
        ),
    },
    PLUGIN_PY,
)
# builder.build: weight-only INT8/INT4, INT8 KV, SmoothQuant and per-channel/per-token scaling raise on these SMs.
BLACKWELL_DC_SM_RANGE = ((100, 120), BUILDER_PY)
# builder.build: quantization whose QuantMode has fp8 rowwise -> set_fp8_rowwise_quant_plugins(model dtype).
FP8_ROWWISE_ALGOS = (("FP8_PER_CHANNEL_PER_TOKEN",), BUILDER_PY)
FP8_ROWWISE_SETS = (
    (
        ("fp8_rowwise_gemm_plugin", "dtype"),
        ("rmsnorm_quantization_plugin", "dtype"),
        ("layernorm_quantization_plugin", "dtype"),
        ("quantize_per_token_plugin", True),
        ("quantize_tensor_plugin", True),
    ),
    PLUGIN_PY,
)
# builder.build: NVFP4 sets gemm_plugin "nvfp4" unless the command line said --gemm_plugin disable.
NVFP4_GEMM = (("NVFP4", "nvfp4"), f"{BUILDER_PY} + {PLUGIN_PY} PluginConfig.from_arguments")
# The FP4 GEMM's minimum SM (Fp4GemmPlugin::init) is the scheme table's tensor_cores column
# (trtpipe.formats.schemes.TENSOR_CORES, with its source).
# CutlassFpAIntBGemmRunner (the group-wise INT4 GEMM of W4A16 AWQ / GPTQ and W4A8 AWQ linears) throws at run time
# unless group_size is 64 or 128, and 128 with FP8 activations: quant_algo -> group sizes it runs, the scheme table's
# engine group_sizes (trtpipe.formats.schemes, where the messages and the source are quoted).
FINEGRAINED_GROUP_SIZES = (
    {s.quant_algo: s.group_sizes["engine"] for s in SCHEMES if "engine" in s.group_sizes},
    FINEGRAINED_SOURCE,
)
# builder.optimize_model_with_config: a (low-latency) GEMM+SwiGLU plugin needs use_fused_mlp.
SWIGLU_PLUGINS_NEED_FUSED_MLP = (("gemm_swiglu_plugin", "low_latency_gemm_swiglu_plugin"), BUILDER_PY)


def cli_default(f: PluginField) -> Any:
    """A CLI plugin field's value when its flag is not given, in trtpipe's spelling (dtype off = "disable")."""
    if f.kind == "dtype":
        return "disable" if f.default is None else f.default
    return f.default
