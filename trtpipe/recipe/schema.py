"""The recipe schema: one YAML file describes a whole deployment.

Policy:
- Every section forbids unknown keys (a typo fails at load time, not after an hour of calibration).
- Types are strict: YAML already types scalars, so ``tp: "2"`` or ``max_batch_size: 1.5`` is an error,
  never a silent conversion.
- Integer fields carry the bounds of the tool they end up in (TensorRT-LLM stores lengths as int32).

Cross-field rules that need the model's ``config.json`` live in :mod:`trtpipe.recipe.rules`; this module only
declares fields, their ranges and their defaults.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from trtpipe.formats.schemes import GROUP_SIZES, RECIPE_ALGOS, RECIPE_KV

INT32_MAX = 2**31 - 1
HF_URI = re.compile(r"^hf://[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


def _keyed(node: BaseModel, dump: dict) -> dict:
    """``dump`` (``node``'s model_dump) without the fields marked ``keyed: False``, at any depth."""
    for name, f in type(node).model_fields.items():
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("keyed") is False:
            dump.pop(name, None)
        elif isinstance(getattr(node, name), BaseModel) and isinstance(dump.get(name), dict):
            _keyed(getattr(node, name), dump[name])
    return dump


DType = Literal["auto", "float16", "bfloat16", "float32"]
# the scheme table's rows (trtpipe.formats.schemes): a new row is a new recipe value
QuantAlgoName = Literal[RECIPE_ALGOS]
KVCacheQuant = Literal[RECIPE_KV]
GroupSize = Literal[GROUP_SIZES]
# the lossy steps of converting a pre-quantized source for the engine target (trtpipe/quant/imported/lossy.py)
LossyImportStep = Literal["fp8_requantize", "zero_point_rounding"]


def _path_text(v: str) -> str:
    """A path written in a recipe: non-empty and free of NUL bytes (which no file system accepts)."""
    if not v.strip():
        raise ValueError("must not be empty")
    if "\x00" in v:
        raise ValueError("must not contain a NUL character")
    return v


class ModelSection(_Section):
    source: str = Field(
        description="Local Hugging Face model directory (relative to the recipe), or hf://org/name[@revision]."
    )
    dtype: DType = Field("auto", description="Model dtype; auto follows TensorRT-LLM (float32 sources become float16).")
    allow_pickle: bool = Field(False, description="Allow .bin (pickle) checkpoints; loaded with weights_only=True.")
    allow_lossy_import: list[LossyImportStep] = Field(
        default_factory=list,
        description="Lossy steps accepted when a pre-quantized source is converted for target "
        "engine: fp8_requantize (fused q/k/v or gate/up FP8 members with different scales requantized to the max), "
        "zero_point_rounding (zero-point INT4's zero rounded to the model dtype). Default: none; validate names "
        "the step a source needs.",
    )

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        _path_text(v)
        if v.startswith("hf://") and not HF_URI.match(v):
            raise ValueError("must look like hf://org/name or hf://org/name@revision")
        return v


DATA_TEXT = (
    "A .txt/.jsonl/.json file or directory, a built-in set (prose, code, arithmetic, chat: no download), "
    "or 'self' (text the model generates)."
)


class MixPart(_Section):
    data: str = Field(description=DATA_TEXT)
    weight: float = Field(1.0, gt=0.0, le=1e6, description="Share of the calibration samples (relative).")

    _data = field_validator("data")(classmethod(lambda cls, v: _path_text(v)))


class CalibrationSection(_Section):
    dataset: str = Field("self", description=DATA_TEXT)
    mix: list[MixPart] = Field(
        default_factory=list,
        description="Calibrate on several sets at once, num_samples shared by weight (instead of dataset): fit "
        "the scales to what the deployment will serve, e.g. prose and code.",
    )
    text_field: str = Field("text", min_length=1, description="Field holding the text in .jsonl/.json records.")
    num_samples: int = Field(64, ge=1, le=100_000, description="Calibration samples.")
    seq_len: int = Field(256, ge=8, le=131_072, description="Tokens per calibration sample.")
    batch_size: int = Field(8, ge=1, le=4096, description="Samples per calibration forward pass.")
    seed: int = Field(1234, ge=0, le=2**32 - 1, description="Seed for sampling and for self-generated text.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto uses CUDA when present.")

    _dataset = field_validator("dataset")(classmethod(lambda cls, v: _path_text(v)))

    @field_validator("mix")
    @classmethod
    def _mix_or_dataset(cls, v, info):
        if v and info.data.get("dataset", "self") != "self":
            raise ValueError("set either dataset or mix, not both (mix lists every set it calibrates on)")
        return v


class QuantizationSection(_Section):
    algo: QuantAlgoName = Field("none", description="Weight/activation quantization (ModelOpt qformat names).")
    kv_cache: KVCacheQuant = Field("none", description="KV-cache quantization.")
    group_size: GroupSize = Field(128, description="Group size for int4_wo/int4_awq/w4a8_awq.")
    smoothquant_alpha: float = Field(0.5, ge=0.0, le=1.0, description="SmoothQuant migration strength (int8_sq).")
    exclude: list[str] = Field(
        default_factory=lambda: ["*lm_head"],
        description="fnmatch patterns of TensorRT-LLM module names kept unquantized (written as exclude_modules).",
    )
    calibration: CalibrationSection = Field(default_factory=CalibrationSection, description="Calibration data.")

    @field_validator("exclude", mode="before")
    @classmethod
    def _one_pattern_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("exclude")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        if any(not p.strip() for p in v):
            raise ValueError("patterns must not be empty")
        return v


class ParallelSection(_Section):
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel size.")
    pp: int = Field(1, ge=1, le=64, description="Pipeline-parallel size (world size is tp*pp).")
    moe_ep: int = Field(-1, ge=-1, le=64, description="MoE expert-parallel size (-1: derived from tp and moe_tp).")
    moe_tp: int = Field(-1, ge=-1, le=64, description="MoE tensor-parallel size (-1: derived from tp and moe_ep).")
    attention_dp: bool = Field(
        False,
        description="llmapi: attention data parallel (TensorRT-LLM enable_attention_dp): each of the tp GPUs runs "
        "attention for its own requests with whole attention weights and its own KV cache; the MoE layers split the "
        "experts by moe_ep x moe_tp. Needs a mixture-of-experts model and tp > 1.",
    )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @field_validator("moe_ep", "moe_tp")
    @classmethod
    def _not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (derived) or a positive size")
        return v


class PluginsSection(_Section):
    preset: str = Field(
        "auto",
        pattern=r"^[A-Za-z0-9][\w.-]*$",
        description="A preset from plugins/ (auto: chosen from the GPU and precision).",
    )
    overrides: dict[str, object] = Field(
        default_factory=dict,
        description="PluginConfig fields to override (scalars: dtype names, enable/disable, numbers).",
    )

    @field_validator("overrides")
    @classmethod
    def _scalars(cls, v: dict[str, object]) -> dict[str, object]:
        for key, value in v.items():
            if value is not None and not isinstance(value, (str, bool, int)):
                raise ValueError(f"'{key}' must be a string, number, true/false or null")
        return v


class KVCacheSection(_Section):
    tokens_per_block: int = Field(32, description="Paged KV block size in tokens (power of two).")
    free_gpu_memory_fraction: float = Field(
        0.9, gt=0.0, lt=1.0, description="Share of free GPU memory for the KV pool."
    )
    max_tokens: Optional[int] = Field(None, ge=1, le=INT32_MAX, description="Cap on KV-cache tokens (default: no cap).")
    enable_reuse: bool = Field(True, description="Reuse KV blocks of shared prefixes.")
    host_memory_bytes: int = Field(0, ge=0, le=2**48, description="Host memory for KV offload (0: none).")

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 1 or v & (v - 1) or v > 1024:
            raise ValueError("must be a power of two from 1 to 1024")
        return v


class EngineSection(_Section):
    gpu: str = Field("h100-sxm-80gb", pattern=r"^[a-z0-9][a-z0-9-]*$", description="Target GPU from the catalog.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="Largest runtime batch.")
    max_input_len: int = Field(1024, ge=1, le=INT32_MAX, description="Longest prompt in tokens.")
    max_seq_len: Optional[int] = Field(
        None,
        ge=2,
        le=INT32_MAX,
        description="Prompt + output tokens. Default: deduced from the model as trtllm-build does.",
    )
    max_num_tokens: int = Field(8192, ge=1, le=INT32_MAX, description="Tokens per engine step (packed batch).")
    max_beam_width: int = Field(1, ge=1, le=16, description="Beam-search width (1: no beam search).")
    plugins: PluginsSection = Field(default_factory=PluginsSection, description="Plugin preset and overrides.")
    kv_cache: KVCacheSection = Field(default_factory=KVCacheSection, description="Paged KV cache.")
    workers: int = Field(1, ge=1, le=64, description="Engines built in parallel.")

    @field_validator("plugins", mode="before")
    @classmethod
    def _preset_name_alone(cls, v):
        return {"preset": v} if isinstance(v, str) else v


class AccuracySlice(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Names the slice in the report and the gate.")
    data: str = Field(description=DATA_TEXT)
    num_samples: Optional[int] = Field(None, ge=1, le=100_000, description="Samples (default: accuracy's).")
    max_ppl_increase_pct: Optional[float] = Field(None, ge=0.0, description="Limit (default: accuracy's).")
    min_top1_agreement: Optional[float] = Field(None, ge=0.0, le=1.0, description="Limit (default: accuracy's).")
    max_kl_divergence: Optional[float] = Field(None, ge=0.0, description="Limit (default: accuracy's).")

    _data = field_validator("data")(classmethod(lambda cls, v: _path_text(v)))


class AccuracySection(_Section):
    enabled: bool = Field(True, description="Measure the quantized model against the unquantized one.")
    eval_data: str = Field("self", description="Held-out text for the aggregate numbers. " + DATA_TEXT)
    num_samples: int = Field(16, ge=1, le=100_000, description="Evaluation samples.")
    seq_len: int = Field(128, ge=8, le=131_072, description="Tokens per evaluation sample.")
    max_ppl_increase_pct: Optional[float] = Field(
        None, ge=0.0, description="Fail the build above this perplexity increase (%)."
    )
    min_top1_agreement: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="Fail below this top-1 token agreement (0..1)."
    )
    max_kl_divergence: Optional[float] = Field(
        None, ge=0.0, description="Fail above this mean KL divergence (nats/token)."
    )
    reference: Optional[str] = Field(
        None,
        description="The unquantized original of a pre-quantized model.source (directory or hf://), which the "
        "gate compares against; without it a pre-quantized source reports perplexity alone.",
    )
    slices: list[AccuracySlice] = Field(
        default_factory=list,
        description="Named evaluation sets, each measured and gated on its own (e.g. prose, code): a loss the "
        "aggregate averages away fails the build naming the slice.",
    )

    _eval_data = field_validator("eval_data")(classmethod(lambda cls, v: _path_text(v)))

    @field_validator("slices")
    @classmethod
    def _unique_names(cls, v):
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"slice names must be unique: {', '.join(dup)} repeated")
        return v


class InstanceCounts(_Section):
    preprocessing: int = Field(1, ge=1, le=256, description="Tokenizer model instances.")
    postprocessing: int = Field(1, ge=1, le=256, description="Detokenizer model instances.")
    tensorrt_llm: int = Field(1, ge=1, le=256, description="tensorrt_llm model instances.")
    bls: int = Field(1, ge=1, le=1024, description="BLS instances (about the engine max batch).")


class TritonSection(_Section):
    model_name: str = Field("ensemble", pattern=r"^[A-Za-z0-9_.-]+$", description="Name clients send requests to.")
    max_batch_size: int = Field(
        64, ge=1, le=4096, description="Triton's request batching bound (<= engine.max_batch_size)."
    )
    streaming: bool = Field(False, description="Decoupled (streaming) transaction policy.")
    batching_strategy: Literal["inflight_fused_batching", "inflight_batching", "v1"] = Field(
        "inflight_fused_batching", description="gpt_model_type of the tensorrt_llm model."
    )
    scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = Field(
        "guaranteed_no_evict", description="batch_scheduler_policy."
    )
    enable_chunked_context: bool = Field(False, description="Split long prompts into max_num_tokens chunks.")
    max_queue_size: int = Field(
        0,
        ge=0,
        le=INT32_MAX,
        description="Requests waiting beyond the running batch before new ones are refused at once (0: unlimited).",
    )
    priority_levels: int = Field(
        0,
        ge=0,
        le=16,
        description="Triton queue priority levels on tensorrt_llm and BLS "
        "(request parameter 'priority', 1 = highest; 0: off).",
    )
    instances: InstanceCounts = Field(default_factory=InstanceCounts, description="Instance counts per model.")
    exclude_input_in_output: bool = Field(True, description="Return only the new tokens.")
    bls: bool = Field(False, description="Serve through tensorrt_llm_bls instead of the ensemble.")
    max_queue_delay_microseconds: int = Field(0, ge=0, le=INT32_MAX, description="Dynamic batching queue delay.")
    warmup: bool = Field(True, description="Warm models up (Triton model_warmup) before the server reports ready.")
    bind: str = Field("127.0.0.1", description="Address the server listens on (loopback unless you mean it).")
    http_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    grpc_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    metrics_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    repo_dir: Optional[str] = Field(None, description="Where to write the model repository (default: in work_dir).")

    @field_validator("bind")
    @classmethod
    def _address(cls, v: str) -> str:
        if v == "localhost":
            return v
        try:
            ipaddress.ip_address(v)
        except ValueError:
            raise ValueError("must be an IP address such as 127.0.0.1 or 0.0.0.0, or localhost") from None
        return v

    _repo_dir = field_validator("repo_dir")(classmethod(lambda cls, v: v if v is None else _path_text(v)))


class ServingSection(_Section):
    """How the served executor protects itself (both front ends: the Triton twin and the OpenAI twin)."""

    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="A request not finished this many "
        "seconds after it arrived fails with a timeout error (OpenAI twin: HTTP 504), "
        "queued or running, so none waits forever.",
    )
    max_queue_size: int = Field(
        -1,
        ge=-1,
        le=INT32_MAX,
        description="OpenAI twin: requests waiting beyond the "
        "running batch before new ones get 429 (-1: 8 per engine batch slot; 0: unlimited). "
        "The Triton twin's bound is triton.max_queue_size.",
    )
    tool_parser: Optional[str] = Field(
        None,
        description="Parser of tool calls in the model's output (trtllm-serve --tool_parser, Dynamo "
        "--dyn-tool-call-parser; names in trtpipe/models/parsers.py). Unset: the model family's default; none: off.",
    )
    reasoning_parser: Optional[str] = Field(
        None,
        description="Parser of reasoning_content (trtllm-serve --reasoning_parser, Dynamo --dyn-reasoning-parser). "
        "Unset: the model family's default; none: off.",
    )
    guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]] = Field(
        None,
        description="Structured output (JSON schema, regex, EBNF, structural tag): the grammar backend "
        "(LlmArgs.guided_decoding_backend; Triton's tensorrt_llm guided_decoding_backend). None: off, and a "
        "request with a guide is refused. llguidance is for the PyTorch backend only (the CPU twin runs both).",
    )


# speculative_config.decoding_type of the PyTorch backend (llmapi) and trtllm-build --speculative_decoding_mode
# (engine): tensorrt_llm/llmapi/llm_args.py@fcd3f316 DecodingBaseConfig.from_dict, tensorrt_llm/commands/build.py@65f1d153
LLMAPI_DECODING_TYPES = ("NGram", "DraftTarget", "Eagle3", "MTP")
ENGINE_DECODING_TYPES = ("draft_tokens_external", "lookahead_decoding", "medusa", "eagle")


class SpeculativeSection(_Section):
    """Speculative decoding, named as TensorRT-LLM's ``speculative_config`` (llmapi) or trtllm-build (engine).

    Cross-field rules (the target's spellings, the feature-combination matrix, the draft model) are in
    :mod:`trtpipe.recipe.speculative`."""

    decoding_type: Literal[("none",) + LLMAPI_DECODING_TYPES + ENGINE_DECODING_TYPES + ("Lookahead",)] = Field(
        "none",
        description="none, or llmapi: NGram | DraftTarget | Eagle3 | MTP; engine: draft_tokens_external | "
        "lookahead_decoding | medusa | eagle (trtllm-build --speculative_decoding_mode). Lookahead (the LLM API's "
        "name) is refused with the reason: the PyTorch backend does not run it; the engine spells it lookahead_decoding.",
    )
    max_draft_len: int = Field(3, ge=1, le=64, description="Draft tokens proposed per step (k).")
    speculative_model: Optional[str] = Field(
        None,
        description="Draft model or head: a local directory or hf://org/name (DraftTarget, Eagle3, engine drafts).",
    )
    max_matching_ngram_size: int = Field(
        2, ge=1, le=64, description="NGram: longest suffix of the sequence looked up for a continuation."
    )
    eagle3_one_model: bool = Field(True, description="Eagle3: draft head inside the target's engine (one model).")
    # lookahead_decoding: executor::LookaheadDecodingConfig (W, N, G), defaults 4 / 3 / 4 (trtpipe/recipe/lookahead.py)
    max_window_size: int = Field(4, ge=1, le=64, description="lookahead_decoding: n-grams in the lookahead branch (W).")
    max_ngram_size: int = Field(3, ge=1, le=64, description="lookahead_decoding: tokens per n-gram (N).")
    max_verification_set_size: int = Field(
        4,
        ge=0,
        le=64,
        description="lookahead_decoding: n-grams verified per step (G); max_draft_len follows from W, N, G.",
    )
    acceptance_length: Optional[float] = Field(
        None,
        description="trtpipe's own key (not TensorRT-LLM's): the expected tokens per target forward (accepted drafts "
        "+ 1; at least 1, at most max_draft_len + 1, a tree's depth + 1, lookahead's max_ngram_size) that `trtpipe "
        "plan` and `trtpipe predict` use for the speculative speed-up; their --acceptance-length overrides it. None: "
        "no speed-up predicted.",
        json_schema_extra={"keyed": False},  # no stage's output depends on it: a change rebuilds nothing
    )
    draft_quantization: Union[Literal[("recipe", "stored") + RECIPE_ALGOS], dict[str, Any]] = Field(
        "recipe",
        description="draft_tokens_external: how the draft_engine stage quantizes the draft. recipe: with the recipe's "
        "quantization section (algo, group_size, exclude, kv_cache, calibration data), by the quantize stage's code; "
        "an algorithm (e.g. int4_awq): that section with this algo instead (a quantized draft for an unquantized "
        "target); a mapping of that section's keys (e.g. {algo: int4_awq, group_size: 64, exclude: [...], "
        "calibration: {num_samples: 32}}): the section with those keys replaced (calibration's keys one by one), the "
        "draft's own settings; none: unquantized at model.dtype; stored: as stored (a pre-quantized draft in its own "
        "format, a plain one at model.dtype). A pre-quantized draft takes stored, or recipe when the recipe quantizes "
        "nothing.",
    )
    num_medusa_heads: Optional[int] = Field(
        None, ge=1, le=64, description="medusa: heads converted into the engine (None: the heads' medusa_num_heads)."
    )
    medusa_choices: Optional[list[list[int]]] = Field(
        None,
        description="medusa: the candidate tree (Triton medusa_choices; None: the chain [[0], [0, 0], ...] of "
        "max_draft_len; max_draft_len must be the number of choices). The CPU twin executes the tree, verified with a "
        "tree attention mask.",
    )
    eagle_choices: Optional[list[list[int]]] = Field(
        None,
        description="eagle: the draft tree (Triton eagle_choices, EagleDecodingConfig.eagle_choices; None: the chain "
        "[[0], [0, 0], ...] of max_draft_len); a tree with siblings is verified with a tree mask. Eagle3: a static "
        "tree (two-model only, as upstream; max_draft_len its number of draft tokens).",
    )
    use_dynamic_tree: bool = Field(
        False,
        description="Eagle3 (one-model, llmapi 1.3): EAGLE-2's dynamic tree (EagleDecodingConfig.use_dynamic_tree); "
        "max_draft_len is then its depth, as upstream. Refused for eagle (engine).",
    )
    dynamic_tree_max_top_k: Optional[int] = Field(
        None, ge=1, description="Eagle3: nodes expanded per layer of the dynamic tree (dynamic_tree_max_topK, >= 2)."
    )
    max_total_draft_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="Eagle3 with use_dynamic_tree: the tree's draft tokens, verified in one target forward "
        "(max_total_draft_tokens; at most K + K*K*(max_draft_len - 1)).",
    )

    @property
    def enabled(self) -> bool:
        return self.decoding_type != "none"

    _model = field_validator("speculative_model")(classmethod(lambda cls, v: v if v is None else _path_text(v)))


class LLMAPISection(_Section):
    """The TensorRT-LLM PyTorch-backend / LLM-API deployment (``target: llmapi``)."""

    version: Literal["1.0", "1.1", "1.2", "1.3"] = Field(
        "1.2", description="TensorRT-LLM release whose trtllm-serve flags and extra_llm_api_options keys are written."
    )
    compressed_tensors: bool = Field(False, description="Also write a compressed-tensors checkpoint (vLLM, SGLang).")
    host: str = Field("127.0.0.1", description="Address trtllm-serve (and the CPU twin) listens on.")

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, v):
        """``--set llmapi.version=1.1`` (and an unquoted ``version: 1.1``) arrive as the YAML number 1.1: a release
        written as a number means the same text (1.1 -> "1.1"); anything else is left for the allowed-values check."""
        if isinstance(v, float) and not isinstance(v, bool) and f"{v:.1f}" == repr(v):
            return f"{v:.1f}"
        return v

    options: dict[str, Any] = Field(
        default_factory=dict,
        description="TorchLlmArgs keys written as given (nested, in order) instead of the ones trtpipe derives: what "
        "`trtpipe recipe import` reads from NVIDIA's examples/configs/database YAMLs. Each must be a key of version's "
        "table; where present, tensor_parallel_size, moe_expert_parallel_size, max_batch_size, max_num_tokens, "
        "max_seq_len and kv_cache_config.free_gpu_memory_fraction are set from parallel and engine.",
    )
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of trtllm-serve (and the CPU twin).")
    served_model_name: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9][\w.:/-]*$", description="Model name clients send (default: the recipe name)."
    )
    nodes: int = Field(1, ge=1, le=1024, description="Nodes for the multi-node launch lines (world = tp * pp).")
    max_shard_bytes: int = Field(
        10 * 10**9, ge=2**20, description="Largest model-*.safetensors shard (ModelOpt: 10GB)."
    )


class LoraSection(_Section):
    """Many fine-tunes on one base: PEFT LoRA adapters served by name (TensorRT-LLM ``LoraConfig``, its
    ``tensorrt_llm/lora_helper.py@585c7565``; the target modules are derived from the adapters)."""

    adapters: dict[str, str] = Field(
        default_factory=dict,
        description="Adapter name -> PEFT adapter directory (relative to the recipe) or hf://org/name[@rev]. "
        "Clients select one by OpenAI model name or lora_request.",
    )
    max_lora_rank: int = Field(
        64, ge=1, le=1024, description="Largest adapter rank r accepted (LoraConfig.max_lora_rank)."
    )
    max_loras: int = Field(
        4,
        ge=1,
        le=4096,
        description="Adapters held for the running batch at once (device cache; least recently used out).",
    )
    max_cpu_loras: int = Field(
        8, ge=1, le=65536, description="Adapters kept loaded in host memory (reloaded from disk on demand beyond it)."
    )

    @field_validator("adapters")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, src in v.items():
            if not re.fullmatch(r"[A-Za-z0-9][\w.:-]*", name):
                raise ValueError(f"adapter name {name!r}: letters, digits and _ . : - only")
            _path_text(src)
        return v


DNS_LABEL = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
DEFAULT_TOLERATIONS = ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},)


class ReplicasSection(_Section):
    min: int = Field(1, ge=1, le=1000, description="Fewest model instances (LWS groups or Deployment pods) kept up.")
    max: int = Field(4, ge=1, le=1000, description="Most instances the autoscaler may run.")


class DeploySection(_Section):
    """What only the cluster's owner knows: where it runs, how many copies, which SLOs to page on."""

    namespace: str = Field("default", pattern=DNS_LABEL, description="Kubernetes namespace of every object.")
    image: Optional[str] = Field(
        None,
        min_length=1,
        description="Serving container image (default: the Triton TRT-LLM image the engine "
        "target pins, nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3, for both targets).",
    )
    storage_class: Optional[str] = Field(
        None,
        min_length=1,
        description="StorageClass of the ReadWriteMany artifact cache volume (default: the cluster's default class).",
    )
    storage_read_gbs: float = Field(
        1.0,
        gt=0.0,
        le=1000.0,
        description="Read bandwidth of that volume in GB/s, "
        "for the planner's load-time estimate behind the startup probe budget.",
    )
    replicas: ReplicasSection = Field(default_factory=ReplicasSection, description="Instance counts.")
    slo: str = Field(
        "ttft_p99=2s,itl_p99=100ms",
        description="Latency SLOs the alerts page on (trtpipe's --slo syntax, percentile terms only: ttft_pQ, itl_pQ).",
    )
    max_error_ratio: float = Field(0.01, gt=0.0, lt=1.0, description="Failed share of requests that pages.")
    kv_cache_alert: float = Field(0.9, gt=0.0, le=1.0, description="KV-cache block use (0..1) that warns.")
    acceptance_drift_alert: float = Field(
        0.8,
        gt=0.0,
        lt=1.0,
        description="Speculative decoding: warn when the draft acceptance rate falls under this fraction of its rate "
        "over the last 6 hours.",
    )
    lora_cache_miss_alert: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="Share of an adapter's steps that activate it into the device cache (lora.max_loras) that warns.",
    )
    gpus_per_node: int = Field(8, ge=1, le=64, description="GPUs on each node of the GPU pool.")
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="nodeSelector labels added to (or overriding) the GPU product label derived from engine.gpu.",
    )
    tolerations: list[dict[str, str]] = Field(
        default_factory=lambda: [dict(t) for t in DEFAULT_TOLERATIONS],
        description="Pod tolerations (default: the nvidia.com/gpu taint).",
    )
    shm_gib: Optional[int] = Field(None, ge=1, le=4096, description="/dev/shm size (default: derived per backend).")
    autoscaler: Literal["hpa", "keda"] = Field("hpa", description="HPA through prometheus-adapter, or KEDA.")
    scale_on: Literal["queue", "kv_cache"] = Field("queue", description="Metric the autoscaler follows.")
    prometheus_url: str = Field(
        "http://prometheus-operated.monitoring:9090",
        min_length=1,
        description="Prometheus that KEDA and prometheus-adapter query.",
    )
    monitor_labels: dict[str, str] = Field(
        default_factory=lambda: {"release": "prometheus"},
        description=("Labels on PodMonitor/PrometheusRule (kube-prometheus-stack selects release: prometheus)."),
    )
    scrape_interval_s: int = Field(15, ge=1, le=3600, description="Prometheus scrape and rule interval.")

    @field_validator("node_labels", "monitor_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not re.fullmatch(r"([a-z0-9.-]+/)?[A-Za-z0-9]([\w.-]{0,61}[A-Za-z0-9])?", key):
                raise ValueError(f"{key!r} is not a Kubernetes label key")
            if not re.fullmatch(r"([A-Za-z0-9]([\w.-]{0,61}[A-Za-z0-9])?)?", value):
                raise ValueError(f"label {key}: {value!r} is not a Kubernetes label value")
        return v

    @field_validator("tolerations")
    @classmethod
    def _tolerations(cls, v: list[dict[str, str]]) -> list[dict[str, str]]:
        allowed = {"key", "operator", "value", "effect"}
        for t in v:
            if set(t) - allowed:
                raise ValueError(f"toleration keys are {', '.join(sorted(allowed))} (got {', '.join(sorted(t))})")
        return v


class Recipe(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Names the build (letters, digits, _ . -).")
    work_dir: str = Field("work", description="Artifacts, logs and manifests; relative to the recipe file.")
    model: ModelSection = Field(description="The model to deploy.")
    quantization: QuantizationSection = Field(default_factory=QuantizationSection, description="Quantization.")
    parallel: ParallelSection = Field(
        default_factory=ParallelSection, description="Tensor/pipeline/expert parallelism."
    )
    engine: EngineSection = Field(default_factory=EngineSection, description="TensorRT-LLM engine build.")
    accuracy: AccuracySection = Field(default_factory=AccuracySection, description="Accuracy gate.")
    triton: TritonSection = Field(default_factory=TritonSection, description="Triton model repository and server.")
    target: Literal["engine", "llmapi"] = Field(
        "engine",
        description="engine: TensorRT engines (TensorRT-LLM <= 1.2); llmapi: quantized HF checkpoint for "
        "the PyTorch backend (trtllm-serve, Triton llmapi model).",
    )
    llmapi: LLMAPISection = Field(default_factory=LLMAPISection, description="The llmapi target's deployment.")
    deploy: DeploySection = Field(default_factory=DeploySection, description="Kubernetes and monitoring.")
    serving: ServingSection = Field(
        default_factory=ServingSection, description="Deadlines and queue bounds of the served executor."
    )
    lora: LoraSection = Field(default_factory=LoraSection, description="LoRA adapters served on the base model.")
    speculative: SpeculativeSection = Field(
        default_factory=SpeculativeSection, description="Speculative decoding (draft, verify, accept)."
    )

    _path: Optional[Path] = PrivateAttr(None)
    _positions: dict = PrivateAttr(default_factory=dict)
    _overrides: dict = PrivateAttr(default_factory=dict)
    _display: Optional[str] = PrivateAttr(None)

    _work_dir = field_validator("work_dir")(classmethod(lambda cls, v: _path_text(v)))

    @property
    def path(self) -> Optional[Path]:
        """The recipe file this came from (None when built in code)."""
        return self._path

    @property
    def base_dir(self) -> Path:
        """Relative paths in a recipe are relative to the recipe file's directory."""
        return self._path.parent if self._path else Path.cwd()

    def resolve(self, value: str) -> Path:
        """Resolve a path written in the recipe (``~`` expanded, relative to the recipe file)."""
        p = Path(value)
        try:
            p = p.expanduser()
        except RuntimeError:  # "~user" of a user that does not exist: keep it literal
            pass
        if p.is_absolute():
            return p
        try:
            return (self.base_dir / p).resolve()
        except (OSError, RuntimeError):  # symlink loops and the like: absolute, unresolved
            return self.base_dir / p

    @property
    def work_path(self) -> Path:
        return self.resolve(self.work_dir)

    def position(self, dotted: str) -> tuple[int, int]:
        """1-based (line, col) of a dotted key in the recipe file, or of its nearest written parent."""
        loc = tuple(dotted.split(".")) if dotted else ()
        for cut in range(len(loc), -1, -1):
            for key in (loc[:cut] + ("<value>",), loc[:cut]):
                if key in self._positions:
                    return self._positions[key]
        return (1, 1) if self._path else (0, 0)

    def locate(self, dotted: str) -> tuple[str, int, int]:
        """(file, line, col) for an error about ``dotted``; a key set by ``--set`` names the override instead."""
        name = self._display or (str(self._path) if self._path else "<recipe>")
        loc = tuple(dotted.split(".")) if dotted else ()
        for cut in range(len(loc), 0, -1):
            if loc[:cut] in self._overrides:
                return f"{name} (--set {self._overrides[loc[:cut]]})", 0, 0
        return (name, *self.position(dotted))

    def written(self, dotted: str) -> bool:
        """Whether the recipe file or an override sets this key (False: the default applies)."""
        loc = tuple(dotted.split("."))
        return loc in self._positions or any(loc[:cut] in self._overrides for cut in range(len(loc), 0, -1))

    def section(self, dotted: str) -> dict:
        """The resolved (defaults filled) dict of a section, e.g. ``"quantization.calibration"``."""
        node: object = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node.model_dump(mode="json") if isinstance(node, BaseModel) else node

    def key_section(self, dotted: str) -> dict:
        """:meth:`section` without the fields no stage's output depends on (``json_schema_extra={"keyed": False}``:
        read by commands such as ``plan`` and ``predict`` only), as a stage key takes it."""
        node: object = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return _keyed(node, node.model_dump(mode="json")) if isinstance(node, BaseModel) else node
