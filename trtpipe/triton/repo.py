"""The Triton model repository as protobuf messages (docs/reference/triton-repository.md),
one function per model, one writer.

Every ``config.pbtxt`` is a ``tritonclient.grpc.model_config_pb2.ModelConfig`` built from the recipe and the
engine's facts and written with ``google.protobuf.text_format``, then parsed back and compared: a typo in a
field name fails here, and no ``${...}`` placeholder can exist. Every parameter the ``tensorrtllm`` backend
reads is written with a deliberate value (an empty string only where "unset" is the deliberate choice, e.g.
``cross_kv_cache_fraction`` which is forbidden for decoder-only models).

Layout written by :func:`write_repo` (self-contained and relocatable for trtpipe's python models: relative paths
resolve against their own directory, and ``tokenizer_dir``, absolute so that upstream's models can be swapped in,
falls back to the ``tokenizer/`` copy beside each model when it no longer exists; see :func:`point_tokenizer_dirs`)::

    preprocessing/   config.pbtxt  1/model.py  tokenizer/
    tensorrt_llm/    config.pbtxt  1/model.py  engine/      (CPU twin: engine dir hardlinked in)
                     config.pbtxt  1/.gitkeep               (TensorRT engine: gpt_model_path = engine dir)
    postprocessing/  config.pbtxt  1/model.py  tokenizer/
    ensemble/        config.pbtxt  1/
    tensorrt_llm_bls/ config.pbtxt 1/model.py  tokenizer/   (when the recipe asks for it, or streams)
    tensorrt_llm_draft/ config.pbtxt 1/model.py engine/     (speculative draft_tokens_external: the draft engine)
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trtpipe.engine.lora_cache import cache_parameters as lora_cache_parameters
from trtpipe.triton.orchestrator import check_placement, device_ids, needs_orchestrator
from trtpipe.errors import ServingError
from trtpipe.extras import require
from trtpipe.triton import upstream_io
from trtpipe.triton.upstream_io import TWIN_EXTRAS_PARAMETER
from trtpipe.triton.xgrammar_info import TOKENIZER_INFO_FILE, write_tokenizer_info
from trtpipe.resources import data_dir
from trtpipe.recipe.lookahead import (
    TRITON_PARAMETERS as LOOKAHEAD_PARAMETERS,
    triton_parameters as lookahead_parameters,
)
from trtpipe.recipe.eagle import triton_choices as eagle_triton_choices
from trtpipe.recipe.medusa import triton_choices
from trtpipe.recipe.knobs import twin_extras
from trtpipe.recipe.schema import Recipe
from trtpipe.jsonfile import load_json

# tritonclient's own protobuf messages write config.pbtxt (the serve extra)
mc = require("tritonclient.grpc.model_config_pb2", "a Triton model repository (trtpipe repo, the repo stage)")
text_format = require("google.protobuf.text_format", "a Triton model repository (trtpipe repo, the repo stage)")

MODEL_CODE = data_dir("model_repo")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
    "generation_config.json",
)
# The python-backend stub runs Python isolated (PYTHONDONTWRITEBYTECODE is ignored) and would write
# __pycache__/ into the repository, changing a sealed build artifact. A plain file of that name makes the
# import system skip writing bytecode (it cannot create the directory) without any other effect.
NO_PYCACHE = "a file, not a directory: keeps the Triton python stub from writing bytecode into this repository\n"
EXECUTOR_WORKER = "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"

T = mc.DataType
# The tensorrt_llm model's I/O: upstream's template rows (trtpipe/triton/upstream_io.py) a decoder-only
# engine declares. The CPU twin declares the same and refuses, per request, what it cannot honour
# (trtpipe/serving/twin_input_policy.py).
TRTLLM_INPUTS = upstream_io.declared(upstream_io.TRTLLM_INPUTS)
TRTLLM_OUTPUTS = upstream_io.declared(upstream_io.TRTLLM_OUTPUTS)
# Inputs only the twin declares, beyond upstream's template. Each one also needs a policy row in
# trtpipe/serving/twin_input_policy.py; the tests hold the twin to "the real model's I/O plus these".
# priority: executor request priority (0..1, default 0.5), so priority scheduling can be tried before deploying
# (the 1.2 backend has no such input and gives every request 0.5).
TWIN_ONLY_INPUTS: tuple[upstream_io.Tensor, ...] = (upstream_io.Tensor("priority", "TYPE_FP32", (1,), optional=True),)
PREPROCESSING_INPUTS = upstream_io.declared(upstream_io.PREPROCESSING_INPUTS)
PREPROCESSING_OUTPUTS = upstream_io.declared(upstream_io.PREPROCESSING_OUTPUTS)

# Ensemble / BLS inputs: (name, dtype, dims, optional, tensorrt_llm or preprocessing input it feeds).
FRONT_INPUTS = [
    ("text_input", T.TYPE_STRING, [1], False, "pre:QUERY"),
    ("max_tokens", T.TYPE_INT32, [1], False, "pre:REQUEST_OUTPUT_LEN"),
    ("bad_words", T.TYPE_STRING, [-1], True, "pre:BAD_WORDS_DICT"),
    ("stop_words", T.TYPE_STRING, [-1], True, "pre:STOP_WORDS_DICT"),
    ("end_id", T.TYPE_INT32, [1], True, "pre:END_ID"),
    ("pad_id", T.TYPE_INT32, [1], True, "pre:PAD_ID"),
    ("top_k", T.TYPE_INT32, [1], True, "llm:runtime_top_k"),
    ("top_p", T.TYPE_FP32, [1], True, "llm:runtime_top_p"),
    ("temperature", T.TYPE_FP32, [1], True, "llm:temperature"),
    ("seed", T.TYPE_UINT64, [1], True, "llm:seed"),
    ("exclude_input_in_output", T.TYPE_BOOL, [1], True, "llm:exclude_input_in_output"),
    ("stream", T.TYPE_BOOL, [1], True, "llm:streaming"),
    # guided decoding (tensorrtllm_backend docs/guided_decoding.md@395c4035 sends them to the ensemble)
    ("guided_decoding_guide_type", T.TYPE_STRING, [1], True, "llm:guided_decoding_guide_type"),
    ("guided_decoding_guide", T.TYPE_STRING, [1], True, "llm:guided_decoding_guide"),
]
# The ensemble's and the BLS's further inputs and outputs, named and mapped as upstream's ensemble template maps
# them (NVIDIA/TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt@2a9abd95) and as
# upstream's BLS passes them to tensorrt_llm and back (tensorrt_llm_bls/1/lib/triton_decoder.py@07f3e442:
# "min_tokens", "return_log_probs" in _get_llm_tensors_from_request; cum_log_probs, output_log_probs in _get_response).
ENSEMBLE_INPUTS = [
    ("min_tokens", T.TYPE_INT32, [1], True, "llm:min_tokens"),
    ("return_log_probs", T.TYPE_BOOL, [1], True, "llm:return_log_probs"),
    # LoRA (the template's lora_task_id / lora_weights / lora_config, mapped by name; triton_decoder.py passes them)
    ("lora_task_id", T.TYPE_UINT64, [1], True, "llm:lora_task_id"),
    ("lora_weights", T.TYPE_FP16, [-1, -1], True, "llm:lora_weights"),
    ("lora_config", T.TYPE_INT32, [-1, 3], True, "llm:lora_config"),
]
ENSEMBLE_LLM_OUTPUTS = [("cum_log_probs", T.TYPE_FP32, [-1]), ("output_log_probs", T.TYPE_FP32, [-1, -1])]
# The BLS also forwards the per-request server measurements (as upstream's BLS does) and returns them with
# its last response: the executor's timestamps and KV counters, and exact token counts.
BLS_PERF_INPUTS = [
    (name, T.TYPE_BOOL, [1], True)
    for name in ("return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens")
]
BLS_PERF_OUTPUTS = [
    ("kv_cache_alloc_new_blocks", T.TYPE_INT32, [1]),
    ("kv_cache_reused_blocks", T.TYPE_INT32, [1]),
    ("kv_cache_alloc_total_blocks", T.TYPE_INT32, [1]),
    ("arrival_time_ns", T.TYPE_INT64, [1]),
    ("first_scheduled_time_ns", T.TYPE_INT64, [1]),
    ("first_token_time_ns", T.TYPE_INT64, [1]),
    ("last_token_time_ns", T.TYPE_INT64, [1]),
    ("num_input_tokens", T.TYPE_INT32, [1]),
    ("num_output_tokens", T.TYPE_INT32, [1]),
]


# Upstream's two-model draft-target form (NVIDIA/TensorRT-LLM examples/draft_target_model/README.md@567239fc, "Triton
# Inference Server workflow"): a second tensorrt_llm model named tensorrt_llm_draft on the draft engine, and the BLS's
# tensorrt_llm_draft_model_name naming it; a request asks for speculation with num_draft_tokens and gets the
# acceptance counters back (tensorrt_llm_bls/config.pbtxt@0193dbd4).
DRAFT_MODEL = "tensorrt_llm_draft"
BLS_DRAFT_INPUTS = [("num_draft_tokens", T.TYPE_INT32, [1], True), ("use_draft_logits", T.TYPE_BOOL, [1], True)]
BLS_DRAFT_OUTPUTS = [
    ("acceptance_rate", T.TYPE_FP32, [1]),
    ("total_accepted_draft_tokens", T.TYPE_INT32, [1]),
    ("total_draft_tokens", T.TYPE_INT32, [1]),
]


def two_model(recipe: Recipe) -> bool:
    """Whether the recipe is served in the two-model draft-target form (``speculative.decoding_type``
    draft_tokens_external: the target built with ``--speculative_decoding_mode draft_tokens_external``)."""
    return recipe.speculative.decoding_type == "draft_tokens_external"


@dataclass(frozen=True)
class EngineInfo:
    """What the repository needs to know about the engine stage's output."""

    path: Path
    twin: bool  # True: CPU twin engine dir (trtpipe_twin.json), False: TensorRT engines
    world_size: int
    max_batch_size: int
    max_beam_width: int
    max_input_len: int
    max_seq_len: int
    version: Optional[str] = None  # TensorRT-LLM version that built the engine (config.json "version")
    sliding_window: Optional[int] = None  # Mistral: attention window; tell the runtime (max_attention_window_size)
    # Gemma 3: per layer "sliding_attention" | "full_attention" (pretrained_config.layer_types); only the sliding
    # layers have the window, so the runtime gets one window per layer
    layer_types: tuple[str, ...] = ()
    dtype: str = "float16"  # pretrained_config.dtype: the prompt embedding table's dtype
    logits_dtype: str = "float32"  # pretrained_config.logits_dtype: the logits tensors' dtype

    @property
    def attention_windows(self) -> list[int]:
        """The window of each layer (Gemma 3): sliding layers min(window, max_seq_len), global ones max_seq_len."""
        window = min(self.sliding_window, self.max_seq_len) if self.sliding_window else self.max_seq_len
        return [window if t == "sliding_attention" else self.max_seq_len for t in self.layer_types]

    @property
    def attention_window(self) -> int | str:
        """``max_attention_window_size``: the model's sliding window when it has one, else max_seq_len; for a model
        whose layers differ (Gemma 3) one window per layer, comma-separated: the backend parses the parameter as a
        list (``max_attention_window`` of TensorRT-LLM's executor KvCacheConfig takes one entry per layer), since the
        engine itself does not carry per-layer windows."""
        if self.layer_types:
            windows = self.attention_windows
            return windows[0] if len(set(windows)) == 1 else ",".join(str(w) for w in windows)
        return min(self.sliding_window, self.max_seq_len) if self.sliding_window else self.max_seq_len

    @classmethod
    def read(cls, engine_dir: Path) -> "EngineInfo":
        cfg_path = Path(engine_dir) / "config.json"
        try:
            cfg = load_json(cfg_path, ServingError)
        except (OSError, ValueError) as exc:
            raise ServingError(f"{cfg_path}: cannot read the engine config ({exc})") from exc
        build = cfg.get("build_config") or {}
        mapping = (cfg.get("pretrained_config") or {}).get("mapping") or {}
        missing = [k for k in ("max_batch_size", "max_input_len", "max_seq_len") if k not in build]
        if missing:
            raise ServingError(f"{cfg_path}: build_config.{missing[0]} is missing")
        world = int(mapping.get("world_size") or int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)))
        return cls(
            path=Path(engine_dir).resolve(),
            twin=(Path(engine_dir) / "trtpipe_twin.json").exists(),
            world_size=world,
            max_batch_size=int(build["max_batch_size"]),
            max_beam_width=int(build.get("max_beam_width", 1)),
            max_input_len=int(build["max_input_len"]),
            max_seq_len=int(build["max_seq_len"]),
            version=cfg.get("version"),
            sliding_window=(cfg.get("pretrained_config") or {}).get("sliding_window"),
            layer_types=tuple((cfg.get("pretrained_config") or {}).get("layer_types") or ()),
            dtype=str((cfg.get("pretrained_config") or {}).get("dtype", "float16")),
            logits_dtype=str((cfg.get("pretrained_config") or {}).get("logits_dtype", "float32")),
        )

    def placeholders(self) -> dict[str, str]:
        """The template placeholders a tensorrt_llm config fills from the engine (fill_template's values)."""
        for what, dtype in (("dtype", self.dtype), ("logits_dtype", self.logits_dtype)):
            if dtype not in upstream_io.TRITON_DTYPE:
                raise ServingError(
                    f"{self.path / 'config.json'}: pretrained_config.{what} {dtype!r} has no Triton type "
                    f"(expected one of {', '.join(upstream_io.TRITON_DTYPE)})"
                )
        return {
            "${logits_datatype}": upstream_io.TRITON_DTYPE[self.logits_dtype],
            "${prompt_embedding_table_data_type}": upstream_io.TRITON_DTYPE[self.dtype],
        }


@dataclass(frozen=True)
class TokenIds:
    """Default end/pad ids and the other EOS ids every request stops on (from generation_config + tokenizer)."""

    end_id: int
    pad_id: int
    stop_ids: tuple[int, ...] = field(default_factory=tuple)


def token_ids(tokenizer_dir: Path) -> TokenIds:
    """All EOS ids of ``generation_config.json`` (int or list) and the tokenizer; the first is ``end_id``."""
    eos: list[int] = []
    pad = None
    gen = Path(tokenizer_dir) / "generation_config.json"
    if gen.exists():
        g = load_json(gen, ServingError)
        e = g.get("eos_token_id")
        eos += [int(x) for x in (e if isinstance(e, list) else [e] if e is not None else [])]
        pad = g.get("pad_token_id")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)  # never run shipped code
    except Exception as exc:  # transformers raises many types; name the directory, keep one line
        why = " ".join(str(exc).split())[:300]
        raise ServingError(f"{tokenizer_dir}: cannot load the tokenizer ({type(exc).__name__}: {why})") from exc
    if tok.eos_token_id is not None and int(tok.eos_token_id) not in eos:
        eos.append(int(tok.eos_token_id))
    if not eos:
        raise ServingError(f"{tokenizer_dir}: no eos_token_id in generation_config.json or the tokenizer")
    if pad is None:
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return TokenIds(end_id=eos[0], pad_id=int(pad), stop_ids=tuple(eos[1:]))


# ---- warm-up (model_warmup): the first request's lazy start-up cost is paid before the server is ready ----
# (model, input) -> (dtype, dims, values). Token ids 1..8 exist in every vocabulary; 4 new tokens exercise
# both the context and the generation phase. Data files live in <model>/warmup/ (Triton's layout).
WARMUP_DIR = "warmup"
WARMUP_DATA = {
    "tensorrt_llm": {
        "input_ids": (T.TYPE_INT32, [8], list(range(1, 9))),
        "input_lengths": (T.TYPE_INT32, [1], [8]),
        "request_output_len": (T.TYPE_INT32, [1], [4]),
    },
    "preprocessing": {
        "QUERY": (T.TYPE_STRING, [1], ["Once upon a time"]),
        "REQUEST_OUTPUT_LEN": (T.TYPE_INT32, [1], [4]),
    },
    "postprocessing": {
        "TOKENS_BATCH": (T.TYPE_INT32, [1, 8], list(range(1, 9))),
        "SEQUENCE_LENGTH": (T.TYPE_INT32, [1], [8]),
    },
}


def add_warmup(config: mc.ModelConfig) -> None:
    """One warm-up request (batch 1) for a model of WARMUP_DATA, read from files written by warmup_files."""
    w = config.model_warmup.add(name=f"{config.name}_warmup", batch_size=1, count=1)
    for name, (dtype, dims, _) in WARMUP_DATA[config.name].items():
        w.inputs[name].data_type = dtype
        w.inputs[name].dims.extend(dims)
        w.inputs[name].input_data_file = name


def warmup_files(model: str) -> dict[str, bytes]:
    """File name -> raw bytes of each warm-up input (row-major; BYTES elements length-prefixed, Triton's format)."""
    import struct

    out = {}
    for name, (dtype, _, values) in WARMUP_DATA[model].items():
        if dtype == T.TYPE_STRING:
            out[name] = b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
        else:
            out[name] = struct.pack(f"<{len(values)}i", *values)
    return out


# ---- message helpers ------------------------------------------------------------------------------


def _io(msg_cls, name, dtype, dims, optional=None):
    m = msg_cls(name=name, data_type=dtype, dims=dims)
    if optional is not None:
        m.optional = optional
    return m


def _declare(msg_cls, row: upstream_io.Tensor, placeholders: dict[str, str]):
    """One template row as a config message, its flags exactly as the template has them."""
    dtype = placeholders.get(row.dtype, row.dtype)
    if dtype.startswith("${"):
        raise ServingError(f"{row.name}: no value for the template placeholder {dtype}")
    m = msg_cls(name=row.name, data_type=T.Value(dtype), dims=list(row.dims))
    if msg_cls is mc.ModelInput:
        if row.optional:
            m.optional = True
        if row.ragged:
            m.allow_ragged_batch = True
        if row.reshape:
            m.reshape.SetInParent()  # reshape: { shape: [ ] }
    return m


def _params(config: mc.ModelConfig, values: dict) -> None:
    for key, value in values.items():
        v = str(value).lower() if isinstance(value, bool) else str(value)
        config.parameters[key].string_value = v


def _batching(
    config: mc.ModelConfig, recipe: Recipe, preferred: Optional[int] = None, queue: int = 0, priority: bool = False
) -> None:
    db = config.dynamic_batching
    db.SetInParent()
    if preferred:
        db.preferred_batch_size.append(preferred)
    db.max_queue_delay_microseconds = recipe.triton.max_queue_delay_microseconds
    db.default_queue_policy.max_queue_size = queue
    if priority and recipe.triton.priority_levels:  # Triton orders its own queue; the 1.2 backend has no priority
        db.priority_levels = recipe.triton.priority_levels
        db.default_priority_level = (recipe.triton.priority_levels + 1) // 2


def _python(name: str, recipe: Recipe, count: int, decoupled: bool = False) -> mc.ModelConfig:
    c = mc.ModelConfig(name=name, backend="python", max_batch_size=recipe.triton.max_batch_size)
    c.instance_group.add(count=count, kind=mc.ModelInstanceGroup.KIND_CPU)
    if decoupled:
        c.model_transaction_policy.decoupled = True
    return c


# ---- one function per model -----------------------------------------------------------------------


def preprocessing_config(recipe: Recipe, engine: EngineInfo, ids: TokenIds) -> mc.ModelConfig:
    """Upstream's preprocessing template (I/O, flags, preferred batch size, parameter keys), text-only.

    Upstream's own ``model.py`` can be dropped in: it looks up every parameter key and output it expects here.
    trtpipe's ``model.py`` reads four more keys (``end_id``, ``pad_id``, ``stop_token_ids``: the model's EOS
    ids; ``max_input_len``: the engine's, to refuse a prompt too long by its characters before tokenizing it) and
    refuses the template's inputs it does not implement (embedding bias words, prompt-table ids).
    """
    c = _python("preprocessing", recipe, recipe.triton.instances.preprocessing)
    _batching(c, recipe, preferred=recipe.triton.max_batch_size)
    c.input.extend(_declare(mc.ModelInput, row, {}) for row in PREPROCESSING_INPUTS)
    c.output.extend(_declare(mc.ModelOutput, row, {}) for row in PREPROCESSING_OUTPUTS)
    _params(
        c,
        {
            "tokenizer_dir": "tokenizer",
            "add_special_tokens": True,
            "multimodal_model_path": "",  # text-only: upstream's model.py treats "" as "no multimodal encoder"
            "gpt_model_path": "../tensorrt_llm/engine" if engine.twin else str(engine.path),  # read only for multimodal
            "max_num_images": "",
            "end_id": ids.end_id,
            "pad_id": ids.pad_id,
            "stop_token_ids": ",".join(str(i) for i in ids.stop_ids),
            "max_input_len": engine.max_input_len,  # trtpipe's: a longer prompt is refused before tokenizing
        },
    )
    return c


def postprocessing_config(recipe: Recipe) -> mc.ModelConfig:
    c = _python("postprocessing", recipe, recipe.triton.instances.postprocessing)
    _batching(c, recipe)
    c.input.extend(
        [
            _io(mc.ModelInput, "TOKENS_BATCH", T.TYPE_INT32, [-1, -1]),
            _io(mc.ModelInput, "SEQUENCE_LENGTH", T.TYPE_INT32, [-1]),
        ]
    )
    c.output.append(_io(mc.ModelOutput, "OUTPUT", T.TYPE_STRING, [-1]))
    _params(c, {"tokenizer_dir": "tokenizer", "skip_special_tokens": True})
    return c


def _trtllm_skeleton(recipe: Recipe, engine: EngineInfo, backend: str, name: str = "tensorrt_llm") -> mc.ModelConfig:
    t = recipe.triton
    c = mc.ModelConfig(name=name, backend=backend, max_batch_size=t.max_batch_size)
    c.model_transaction_policy.decoupled = t.streaming
    _batching(c, recipe, preferred=t.max_batch_size, queue=t.max_queue_size, priority=True)  # queue: maxQueueSize
    c.instance_group.add(count=t.instances.tensorrt_llm, kind=mc.ModelInstanceGroup.KIND_CPU)
    fill = engine.placeholders()
    c.input.extend(_declare(mc.ModelInput, row, fill) for row in TRTLLM_INPUTS)
    c.output.extend(_declare(mc.ModelOutput, row, fill) for row in TRTLLM_OUTPUTS)
    return c


def trtllm_parameters(recipe: Recipe, engine: EngineInfo) -> dict:
    """Every parameter the ``tensorrtllm`` C++ backend reads (triton-repository.md#tensorrt_llm), valued from the
    recipe/engine."""
    kv, t = recipe.engine.kv_cache, recipe.triton
    return {
        "gpt_model_type": t.batching_strategy,
        "gpt_model_path": str(engine.path),
        "encoder_model_path": "",
        "max_beam_width": engine.max_beam_width,
        "batch_scheduler_policy": t.scheduler_policy,
        "kv_cache_free_gpu_mem_fraction": kv.free_gpu_memory_fraction,
        "max_tokens_in_paged_kv_cache": kv.max_tokens if kv.max_tokens is not None else "",
        "cross_kv_cache_fraction": "",  # enc-dec only; forbidden for decoder-only models
        "kv_cache_host_memory_bytes": kv.host_memory_bytes,
        "kv_cache_onboard_blocks": True,
        "max_attention_window_size": engine.attention_window,
        "sink_token_length": "",
        "enable_kv_cache_reuse": kv.enable_reuse,
        "enable_chunked_context": t.enable_chunked_context,
        "normalize_log_probs": True,
        "exclude_input_in_output": t.exclude_input_in_output,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "iter_stats_max_iterations": 1000,
        "request_stats_max_iterations": 0,
        "decoding_mode": "top_k_top_p" if engine.max_beam_width == 1 else "beam_search",
        **dict.fromkeys(LOOKAHEAD_PARAMETERS, ""),
        **lookahead_parameters(recipe),  # decoding_mode lookahead and the executor's (W, N, G)
        "medusa_choices": triton_choices(recipe),  # "{0}, {0, 0}" (docs/model_config.md@7bc57da0)
        "eagle_choices": eagle_triton_choices(recipe),  # the same brace format (docs/model_config.md@7bc57da0)
        "gpu_weights_percent": 1.0,
        "multi_block_mode": True,
        "enable_context_fmha_fp32_acc": False,
        "cuda_graph_mode": False,
        "cuda_graph_cache_size": 0,
        "gpu_device_ids": "",
        "participant_ids": "",
        "num_nodes": 1,
        "lora_cache_optimal_adapter_size": 8,
        "lora_cache_max_adapter_size": 64,
        "lora_cache_gpu_memory_fraction": 0.05,
        "lora_cache_host_memory_bytes": 1 << 30,
        "lora_prefetch_dir": "",
        # the engine's LoRA adapters: the prefetch dir the engine stage converted them into, the caches sized by them
        **lora_cache_parameters(recipe, engine.path),
        "speculative_decoding_fast_logits": False,
        # guided decoding: the backend, and the tokenizer information write_repo puts beside this model (the path
        # made absolute there, as tokenizer_dir is)
        "guided_decoding_backend": recipe.serving.guided_decoding_backend or "",
        "xgrammar_tokenizer_info_path": TOKENIZER_INFO_FILE if recipe.serving.guided_decoding_backend else "",
        "tokenizer_dir": "../preprocessing/tokenizer",
        "executor_worker_path": EXECUTOR_WORKER,
        "recv_poll_period_ms": 0,
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
    }


# The backend parameters the twin's executor honours (same names and values as the real model's).
TWIN_PARAMETERS = (
    "gpt_model_type",
    "batch_scheduler_policy",
    "max_tokens_in_paged_kv_cache",
    "enable_kv_cache_reuse",
    "enable_chunked_context",
    "exclude_input_in_output",
    "cancellation_check_period_ms",
    "stats_check_period_ms",
    "guided_decoding_backend",
    "xgrammar_tokenizer_info_path",
    "lora_cache_host_memory_bytes",  # the twin's host adapter cache holds as many of the largest adapter
    "lora_prefetch_dir",  # made relative to the twin's engine link below
    "medusa_choices",  # the tree the twin drafts (trtpipe.serving.medusa.check_choices)
    "eagle_choices",  # checked against the recipe's tree the twin drafts (trtpipe.serving.medusa.check_choices)
    "decoding_mode",  # lookahead: the executor's (W, N, G) from the lookahead_* parameters (trtpipe.serving.lookahead)
    *LOOKAHEAD_PARAMETERS,
)


def tensorrt_llm_config(recipe: Recipe, engine: EngineInfo, name: str = "tensorrt_llm") -> mc.ModelConfig:
    """The ``tensorrt_llm`` model (or, ``name`` tensorrt_llm_draft, the draft model of the two-model form on the
    draft's engine): the C++ ``tensorrtllm`` backend on TensorRT engines, else the CPU twin.

    Both declare the same I/O (upstream's template); the twin's parameters are its own. The draft model's KV reuse is
    on, as upstream's README configures both models (each BLS round asks it again for the whole sequence).
    """
    real = trtllm_parameters(recipe, engine)
    if name == DRAFT_MODEL:  # reuse on; no grammar (the target's verification keeps the output the target's)
        real.update(enable_kv_cache_reuse=True, guided_decoding_backend="", xgrammar_tokenizer_info_path="")
    if not engine.twin:
        c = _trtllm_skeleton(recipe, engine, "tensorrtllm", name)
        _params(c, real)
        return c
    c = _trtllm_skeleton(recipe, engine, "python", name)
    c.input.extend(_declare(mc.ModelInput, row, engine.placeholders()) for row in TWIN_ONLY_INPUTS)
    _params(
        c,
        {
            "gpt_model_path": "engine",
            "cpu_threads": 1,
            # the recipe's executor knobs the C++ backend has no parameter for (request_timeout_s: the executor's
            # allottedTimeMs for every request, so no request waits forever), as one JSON object; in the two-model
            # form neither model drafts by itself (the BLS brings the drafts)
            TWIN_EXTRAS_PARAMETER: twin_extras(recipe, speculation=not two_model(recipe)),
            **{k: real[k] for k in TWIN_PARAMETERS},
            # the engine is linked in as engine/: the prefetch dir inside it, so a moved repository still finds it
            **(
                {"lora_prefetch_dir": "engine/" + Path(real["lora_prefetch_dir"]).name}
                if real["lora_prefetch_dir"]
                else {}
            ),
        },
    )
    return c


def ensemble_config(recipe: Recipe) -> mc.ModelConfig:
    """pre → tensorrt_llm → post (triton-repository.md#ensemble), restricted to the inputs the models here
    implement."""
    c = mc.ModelConfig(name=recipe.triton.model_name, platform="ensemble", max_batch_size=recipe.triton.max_batch_size)
    c.input.extend(_io(mc.ModelInput, n, d, dims, opt) for n, d, dims, opt, _ in FRONT_INPUTS + ENSEMBLE_INPUTS)
    c.output.append(_io(mc.ModelOutput, "text_output", T.TYPE_STRING, [-1]))
    c.output.extend(_io(mc.ModelOutput, n, d, dims) for n, d, dims in ENSEMBLE_LLM_OUTPUTS)
    steps = c.ensemble_scheduling.step
    pre = steps.add(model_name="preprocessing", model_version=-1)
    for name, *_, target in FRONT_INPUTS:
        if target.startswith("pre:"):
            pre.input_map[target[4:]] = name
    for out in ("INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS", "BAD_WORDS_IDS"):
        pre.output_map[out] = f"_{out}"
    pre.output_map["OUT_END_ID"] = "_PREPROCESSOR_END_ID"
    pre.output_map["OUT_PAD_ID"] = "_PREPROCESSOR_PAD_ID"
    llm = steps.add(model_name="tensorrt_llm", model_version=-1)
    llm.input_map.update(
        {
            "input_ids": "_INPUT_ID",
            "input_lengths": "_REQUEST_INPUT_LEN",
            "request_output_len": "_REQUEST_OUTPUT_LEN",
            "end_id": "_PREPROCESSOR_END_ID",
            "pad_id": "_PREPROCESSOR_PAD_ID",
            "stop_words_list": "_STOP_WORDS_IDS",
            "bad_words_list": "_BAD_WORDS_IDS",
        }
    )
    for name, *_, target in FRONT_INPUTS + ENSEMBLE_INPUTS:
        if target.startswith("llm:"):
            llm.input_map[target[4:]] = name
    llm.output_map.update({"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"})
    llm.output_map.update({n: n for n, *_ in ENSEMBLE_LLM_OUTPUTS})
    post = steps.add(model_name="postprocessing", model_version=-1)
    post.input_map.update({"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"})
    post.output_map["OUTPUT"] = "text_output"
    return c


def bls_config(recipe: Recipe) -> mc.ModelConfig:
    """``tensorrt_llm_bls`` (triton-repository.md#tensorrt_llm_bls): the ensemble's inputs, decoupled when
    streaming, exact text deltas."""
    c = _python("tensorrt_llm_bls", recipe, recipe.triton.instances.bls, decoupled=recipe.triton.streaming)
    c.input.extend(_io(mc.ModelInput, n, d, dims, opt) for n, d, dims, opt, _ in FRONT_INPUTS + ENSEMBLE_INPUTS)
    c.input.extend(_io(mc.ModelInput, n, d, dims, opt) for n, d, dims, opt in BLS_PERF_INPUTS)
    c.output.append(_io(mc.ModelOutput, "text_output", T.TYPE_STRING, [-1]))
    c.output.extend(_io(mc.ModelOutput, n, d, dims) for n, d, dims in ENSEMBLE_LLM_OUTPUTS + BLS_PERF_OUTPUTS)
    # declared always, as upstream's template does: without a draft model num_draft_tokens is refused in one line
    c.input.extend(_io(mc.ModelInput, n, d, dims, opt) for n, d, dims, opt in BLS_DRAFT_INPUTS)
    c.output.extend(_io(mc.ModelOutput, n, d, dims) for n, d, dims in BLS_DRAFT_OUTPUTS)
    if recipe.triton.priority_levels:
        _batching(c, recipe, priority=True)
    _params(
        c,
        {
            "accumulate_tokens": True,
            "tensorrt_llm_model_name": "tensorrt_llm",
            "tensorrt_llm_draft_model_name": DRAFT_MODEL if two_model(recipe) else "",
            "multimodal_encoders_name": "",
            "tokenizer_dir": "tokenizer",
        },
    )
    return c


def point_tokenizer_dirs(configs: dict[str, mc.ModelConfig], tokenizer_dir: Path) -> None:
    """Set every model's ``tokenizer_dir`` parameter to ``tokenizer_dir`` made absolute.

    Why absolute: upstream's python models (preprocessing, postprocessing, BLS) and the ``tensorrtllm`` backend
    pass ``tokenizer_dir`` to ``AutoTokenizer.from_pretrained`` as it is, so a relative one resolves against
    tritonserver's working directory, not the model's (NVIDIA/TensorRT-LLM
    ``triton_backend/all_models/inflight_batcher_llm/preprocessing/1/model.py@beb339f5``:
    ``AutoTokenizer.from_pretrained(tokenizer_dir, ...)``). An absolute path works for them from any directory.

    Why this directory: the repository is written under a temporary name and renamed into place (here and by the
    build cache), so its own final path is not known while it is written; the tokenizer files it copies from (the
    checkpoint artifact, sealed before this stage runs) are, and hold the same files as the copy beside each
    model. trtpipe's own models read this path and fall back to that copy when it is gone (a repository moved to
    another machine), so the repository stays relocatable for them; upstream's need the path to exist.
    """
    path = str(Path(tokenizer_dir).resolve())
    for config in configs.values():
        if "tokenizer_dir" in config.parameters:
            config.parameters["tokenizer_dir"].string_value = path


def repo_configs(
    recipe: Recipe, engine: EngineInfo, ids: TokenIds, draft: Optional[EngineInfo] = None
) -> dict[str, mc.ModelConfig]:
    """Model directory name → config message for everything the recipe asks for (``draft``: the draft engine of
    the two-model form, which also writes the BLS that drives it)."""
    configs = {
        "preprocessing": preprocessing_config(recipe, engine, ids),
        "tensorrt_llm": tensorrt_llm_config(recipe, engine),
        "postprocessing": postprocessing_config(recipe),
        recipe.triton.model_name: ensemble_config(recipe),
    }
    if draft is not None:
        configs[DRAFT_MODEL] = tensorrt_llm_config(recipe, draft, DRAFT_MODEL)
        if not engine.twin and needs_orchestrator(True, engine.world_size):  # orchestrator mode: each model placed
            ids = device_ids(engine.world_size, draft.world_size)
            worlds = {"tensorrt_llm": engine.world_size, DRAFT_MODEL: draft.world_size}
            check_placement(ids, worlds, recipe.deploy.gpus_per_node, "repo")
            for name, value in ids.items():
                configs[name].parameters["gpu_device_ids"].string_value = value
    if recipe.triton.bls or recipe.triton.streaming or draft is not None:
        configs["tensorrt_llm_bls"] = bls_config(recipe)
    if recipe.triton.warmup:
        for name in WARMUP_DATA:
            add_warmup(configs[name])
    return configs


# ---- the writer -----------------------------------------------------------------------------------


def to_pbtxt(config: mc.ModelConfig) -> str:
    """Text format, parsed back and compared (the check that what we wrote is what we meant)."""
    text = text_format.MessageToString(config)
    back = text_format.Parse(text, mc.ModelConfig())
    if back != config or "${" in text:
        raise ServingError(f"{config.name}: config.pbtxt does not round-trip")
    return text


def _link_tree(src: Path, dst: Path) -> None:
    """Hardlink a directory tree (copy across filesystems): relocatable without doubling the disk use."""

    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link)


def tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    files = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).exists()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model") for f in files):
        raise ServingError(f"{tokenizer_dir}: no tokenizer files (tokenizer.json / tokenizer.model) to copy")
    return files


def copy_tokenizer(tokenizer_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in tokenizer_files(tokenizer_dir):
        shutil.copy2(f, dst / f.name)


def write_repo(
    recipe: Recipe, engine_dir: Path, tokenizer_dir: Path, out: Path, draft_engine_dir: Optional[Path] = None
) -> dict[str, mc.ModelConfig]:
    """Write the whole repository into ``out`` (which must not exist yet); return the configs written.

    Args:
        recipe: the resolved recipe (its ``triton`` and ``engine.kv_cache`` sections are read).
        engine_dir: the engine stage's output (TensorRT engines, or the CPU twin dir with ``checkpoint/``).
        tokenizer_dir: directory with the tokenizer files and ``generation_config.json``.
        out: destination (absent or empty); written under a temporary name and renamed at the end, so a
            failure leaves nothing behind.
        draft_engine_dir: the draft engine (the draft_engine stage's output) of a recipe with
            ``speculative.decoding_type: draft_tokens_external``, served as ``tensorrt_llm_draft``; required there,
            refused elsewhere.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ServingError(f"{out}: already exists; remove it or choose another directory")
    if two_model(recipe) != (draft_engine_dir is not None):
        raise ServingError(
            "speculative.decoding_type draft_tokens_external: the repository needs the draft model's engine "
            "(tensorrt_llm_draft)"
            if draft_engine_dir is None
            else f"{draft_engine_dir}: a draft engine is served only with speculative.decoding_type draft_tokens_external"
        )
    engine = EngineInfo.read(engine_dir)
    draft = EngineInfo.read(draft_engine_dir) if draft_engine_dir is not None else None
    if draft is not None and draft.twin != engine.twin:
        raise ServingError(
            f"{draft_engine_dir}: the draft engine and the target engine must both be TensorRT or both the CPU twin"
        )
    tokenizer_files(tokenizer_dir)
    ids = token_ids(tokenizer_dir)
    configs = repo_configs(recipe, engine, ids, draft)
    point_tokenizer_dirs(configs, tokenizer_dir)
    info_param = configs["tensorrt_llm"].parameters["xgrammar_tokenizer_info_path"]
    if info_param.string_value:  # where the file will be once the repository is in place
        info_param.string_value = str((out / "tensorrt_llm" / TOKENIZER_INFO_FILE).resolve())
    texts = {name: to_pbtxt(c) for name, c in configs.items()}
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name, text in texts.items():
            model_dir = tmp / name
            (model_dir / "1").mkdir(parents=True)
            (model_dir / "config.pbtxt").write_text(text)
            code_name = "tensorrt_llm" if name == DRAFT_MODEL else name
            code = MODEL_CODE / code_name / "1" / "model.py"
            if name in ("tensorrt_llm", DRAFT_MODEL) and not engine.twin:
                (model_dir / "1" / ".gitkeep").touch()
            elif name != recipe.triton.model_name:
                shutil.copy2(code, model_dir / "1" / "model.py")
                (model_dir / "1" / "__pycache__").write_text(NO_PYCACHE)
            if name in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
                copy_tokenizer(tokenizer_dir, model_dir / "tokenizer")
            if name == "tensorrt_llm" and info_param.string_value:
                write_tokenizer_info(tokenizer_dir, model_dir)  # generate_xgrammar_tokenizer_info.py's file
            if configs[name].model_warmup:
                (model_dir / WARMUP_DIR).mkdir()
                for fname, data in warmup_files(name).items():
                    (model_dir / WARMUP_DIR / fname).write_bytes(data)
        if engine.twin:
            _link_tree(engine.path, tmp / "tensorrt_llm" / "engine")
        if draft is not None and draft.twin:
            _link_tree(draft.path, tmp / DRAFT_MODEL / "engine")
        (tmp / "trtpipe_repo.json").write_text(
            json.dumps(
                {
                    "recipe": recipe.name,
                    "engine": str(engine.path),
                    **({"draft_engine": str(draft.path)} if draft is not None else {}),
                    "twin": engine.twin,
                    "world_size": engine.world_size,
                    "engine_version": engine.version,
                    "model_name": recipe.triton.model_name,
                    "streaming": recipe.triton.streaming,
                    "end_id": ids.end_id,
                    "pad_id": ids.pad_id,
                    "stop_ids": list(ids.stop_ids),
                    "max_input_len": engine.max_input_len,
                    "max_seq_len": engine.max_seq_len,
                },
                indent=2,
            )
            + "\n"
        )
        if out.exists():  # an empty directory (the build stage's output folder)
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return configs


def export_repo(src: Path, dst: Path) -> Path:
    """Hardlink a built repository to ``dst`` (``triton.repo_dir``), replacing an older export atomically."""
    dst = Path(dst)
    if dst.exists() and not (dst / "trtpipe_repo.json").exists():
        raise ServingError(f"{dst}: exists and is not a trtpipe model repository; choose another triton.repo_dir")
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _link_tree(Path(src), tmp)
    old = dst.with_name(f".{dst.name}.old{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst


def read_configs(repo: Path) -> dict[str, mc.ModelConfig]:
    """Parse every ``config.pbtxt`` of a repository back into messages."""
    return {
        p.parent.name: text_format.Parse(p.read_text(), mc.ModelConfig())
        for p in sorted(Path(repo).glob("*/config.pbtxt"))
    }
