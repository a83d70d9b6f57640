"""The recipe schema: one YAML file describes a whole deployment.

Every model forbids unknown keys (a typo fails at load time, not after an hour of calibration).
Cross-field rules that need no weights live in ``trtpipe.recipe.rules``; this module only declares
fields, their ranges and their defaults.
"""

from __future__ import annotations

from typing import Literal, Optional

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DType = Literal["auto", "float16", "bfloat16", "float32"]
QuantAlgoName = Literal["none", "fp8", "int8_sq", "int8_wo", "int4_wo", "int4_awq", "w4a8_awq"]
KVCacheQuant = Literal["none", "fp8", "int8"]


class ModelSection(_Section):
    source: str = Field(description="Local Hugging Face model directory, or hf://org/name[@revision].")
    dtype: DType = Field("auto", description="Model dtype; auto follows TensorRT-LLM (float32 sources become float16).")
    trust_remote_code: bool = Field(False, description="Allow running code shipped with the checkpoint.")
    allow_pickle: bool = Field(False, description="Allow .bin (pickle) checkpoints; loaded with weights_only=True.")


class CalibrationSection(_Section):
    dataset: str = Field("self", description="A .txt/.jsonl/.json file or directory, or 'self' (text the model generates).")
    text_field: str = Field("text", description="Field holding the text in .jsonl/.json records.")
    num_samples: int = Field(64, ge=1, le=100_000)
    seq_len: int = Field(256, ge=8, le=131_072)
    batch_size: int = Field(8, ge=1, le=4096)
    seed: int = Field(1234, ge=0)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto uses CUDA when present.")


class QuantizationSection(_Section):
    algo: QuantAlgoName = "none"
    kv_cache: KVCacheQuant = "none"
    group_size: int = Field(128, description="Group size for int4_wo/int4_awq/w4a8_awq.")
    smoothquant_alpha: float = Field(0.5, ge=0.0, le=1.0)
    exclude: list[str] = Field(
        default_factory=lambda: ["*lm_head"],
        description="fnmatch patterns of modules kept unquantized (written as exclude_modules).",
    )
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v not in (32, 64, 128, 256):
            raise ValueError("must be one of 32, 64, 128, 256")
        return v

    @field_validator("exclude", mode="before")
    @classmethod
    def _one_pattern_is_a_list(cls, v):
        return [v] if isinstance(v, str) else v


class ParallelSection(_Section):
    tp: int = Field(1, ge=1, le=64, description="Tensor-parallel size.")
    pp: int = Field(1, ge=1, le=64, description="Pipeline-parallel size.")
    moe_ep: int = Field(-1, ge=-1, le=64, description="MoE expert-parallel size (-1: derived).")
    moe_tp: int = Field(-1, ge=-1, le=64, description="MoE tensor-parallel size (-1: derived).")

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
    preset: str = Field("auto", description="A preset from plugins/ (auto: chosen from the GPU and precision).")
    overrides: dict[str, object] = Field(default_factory=dict, description="PluginConfig fields to override.")


class KVCacheSection(_Section):
    tokens_per_block: int = Field(32, description="Paged KV block size in tokens (power of two).")
    free_gpu_memory_fraction: float = Field(0.9, gt=0.0, lt=1.0)
    max_tokens: Optional[int] = Field(None, ge=1)
    enable_reuse: bool = True
    host_memory_bytes: int = Field(0, ge=0)

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v < 1 or v & (v - 1) or v > 1024:
            raise ValueError("must be a power of two between 1 and 1024")
        return v


class EngineSection(_Section):
    gpu: str = Field("h100-sxm-80gb", description="Target GPU from the catalog (trtpipe plan --list-gpus).")
    max_batch_size: int = Field(64, ge=1, le=4096)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: Optional[int] = Field(None, ge=2, description="Default: deduced from the model as trtllm-build does.")
    max_num_tokens: int = Field(8192, ge=1)
    max_beam_width: int = Field(1, ge=1, le=16)
    plugins: PluginsSection = Field(default_factory=PluginsSection)
    kv_cache: KVCacheSection = Field(default_factory=KVCacheSection)
    workers: int = Field(1, ge=1, le=64)

    @field_validator("plugins", mode="before")
    @classmethod
    def _preset_name_alone(cls, v):
        return {"preset": v} if isinstance(v, str) else v


class AccuracySection(_Section):
    enabled: bool = True
    eval_data: str = Field("self", description="Held-out text file/dir for perplexity, or 'self'.")
    num_samples: int = Field(16, ge=1)
    seq_len: int = Field(128, ge=8)
    max_ppl_increase_pct: Optional[float] = Field(None, ge=0.0, description="Fail the build above this increase.")
    min_top1_agreement: Optional[float] = Field(None, ge=0.0, le=1.0)
    max_kl_divergence: Optional[float] = Field(None, ge=0.0)


class InstanceCounts(_Section):
    preprocessing: int = Field(1, ge=1, le=256)
    postprocessing: int = Field(1, ge=1, le=256)
    tensorrt_llm: int = Field(1, ge=1, le=256)
    bls: int = Field(1, ge=1, le=1024)


class TritonSection(_Section):
    model_name: str = Field("ensemble", pattern=r"^[A-Za-z0-9_.-]+$")
    max_batch_size: int = Field(64, ge=1, le=4096)
    streaming: bool = False
    batching_strategy: Literal["inflight_fused_batching", "inflight_batching", "v1"] = "inflight_fused_batching"
    scheduler_policy: Literal["max_utilization", "guaranteed_no_evict"] = "guaranteed_no_evict"
    instances: InstanceCounts = Field(default_factory=InstanceCounts)
    exclude_input_in_output: bool = True
    bls: bool = False
    max_queue_delay_microseconds: int = Field(0, ge=0)
    bind: str = "127.0.0.1"
    http_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    grpc_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    metrics_port: Optional[int] = Field(None, ge=1, le=65535, description="Default: a free port.")
    repo_dir: Optional[str] = Field(None, description="Where to write the model repository (default: in work_dir).")


class Recipe(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    work_dir: str = Field("work", description="Artifacts, logs and manifests; relative to the recipe file.")
    model: ModelSection
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    accuracy: AccuracySection = Field(default_factory=AccuracySection)
    triton: TritonSection = Field(default_factory=TritonSection)

    _path: Optional[Path] = PrivateAttr(None)
    _positions: dict = PrivateAttr(default_factory=dict)

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
        p = Path(value).expanduser()
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    @property
    def work_path(self) -> Path:
        return self.resolve(self.work_dir)

    def position(self, dotted: str) -> tuple[int, int]:
        """1-based (line, col) of a dotted key in the recipe file, or of its nearest written parent."""
        loc = tuple(dotted.split("."))
        for cut in range(len(loc), -1, -1):
            for key in (loc[:cut] + ("<value>",), loc[:cut]):
                if key in self._positions:
                    return self._positions[key]
        return (1, 1) if self._path else (0, 0)

    def section(self, dotted: str) -> dict:
        """The resolved (defaults filled) dict of a section, e.g. ``"quantization.calibration"``."""
        node: object = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node.model_dump(mode="json") if isinstance(node, BaseModel) else node
