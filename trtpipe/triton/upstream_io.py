"""The I/O declarations of upstream's Triton templates for the version trtpipe targets, kept as data.

One row per tensor, exactly as the template declares it (dtype or ``${placeholder}``, dims, ``optional``,
``allow_ragged_batch``, ``reshape: { shape: [ ] }``), with the template file@commit it was read from
(NVIDIA/TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm``). :mod:`trtpipe.triton.repo` builds the
``tensorrt_llm`` and ``preprocessing`` configs from these rows and the tests compare the written configs with
them, so following a new template is an edit of this file.

``scope`` says which rows a decoder-only LLM repository declares: ``decoder`` rows always, ``enc-dec`` and
``multimodal`` rows never (trtpipe builds neither encoder-decoder nor multimodal engines).
"""

from __future__ import annotations

from dataclasses import dataclass

_BASE = "triton_backend/all_models/inflight_batcher_llm"
TRTLLM_TEMPLATE = f"{_BASE}/tensorrt_llm/config.pbtxt@2a9abd95"
PREPROCESSING_TEMPLATE = f"{_BASE}/preprocessing/config.pbtxt@808059da"

# The one parameter the CPU twin's tensorrt_llm model adds to the template's: the recipe's executor knobs that no
# upstream parameter carries, as one JSON object (trtpipe.recipe.knobs.twin_extras writes it,
# trtpipe.serving.triton_adapter reads it).
TWIN_EXTRAS_PARAMETER = "executor_extras"


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # "TYPE_INT32", ... or a template placeholder such as "${logits_datatype}"
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch: true
    reshape: bool = False  # reshape: { shape: [ ] }
    scope: str = "decoder"  # "decoder" | "enc-dec" | "multimodal"
    source: str = TRTLLM_TEMPLATE


def _in(name, dtype, dims, *flags, scope="decoder"):
    """A tensorrt_llm input; flags: "opt", "ragged", "reshape"."""
    return Tensor(name, dtype, tuple(dims), "opt" in flags, "ragged" in flags, "reshape" in flags, scope)


_SCALAR = ("opt", "reshape")  # the common case: an optional [1] input reshaped to a scalar

# tensorrt_llm inputs, in template order.
TRTLLM_INPUTS: tuple[Tensor, ...] = (
    _in("input_ids", "TYPE_INT32", [-1], "ragged", "opt"),
    _in("encoder_input_features", "${encoder_input_features_data_type}", [-1, -1], "ragged", "opt", scope="enc-dec"),
    _in("encoder_output_lengths", "TYPE_INT32", [1], *_SCALAR, scope="enc-dec"),
    _in("input_lengths", "TYPE_INT32", [1], "reshape"),
    _in("request_output_len", "TYPE_INT32", [1], "reshape"),
    _in("num_return_sequences", "TYPE_INT32", [1], *_SCALAR),
    _in("draft_input_ids", "TYPE_INT32", [-1], "opt", "ragged"),
    _in("decoder_input_ids", "TYPE_INT32", [-1], "opt", "ragged", scope="enc-dec"),
    _in("decoder_input_lengths", "TYPE_INT32", [1], *_SCALAR, scope="enc-dec"),
    _in("draft_logits", "${logits_datatype}", [-1, -1], "opt", "ragged"),
    _in("draft_acceptance_threshold", "TYPE_FP32", [1], *_SCALAR),
    _in("end_id", "TYPE_INT32", [1], *_SCALAR),
    _in("pad_id", "TYPE_INT32", [1], *_SCALAR),
    _in("stop_words_list", "TYPE_INT32", [2, -1], "opt", "ragged"),
    _in("bad_words_list", "TYPE_INT32", [2, -1], "opt", "ragged"),
    _in("embedding_bias", "TYPE_FP32", [-1], "opt", "ragged"),
    _in("beam_width", "TYPE_INT32", [1], *_SCALAR),
    _in("temperature", "TYPE_FP32", [1], *_SCALAR),
    _in("runtime_top_k", "TYPE_INT32", [1], *_SCALAR),
    _in("runtime_top_p", "TYPE_FP32", [1], *_SCALAR),
    _in("runtime_top_p_min", "TYPE_FP32", [1], *_SCALAR),
    _in("runtime_top_p_decay", "TYPE_FP32", [1], *_SCALAR),
    _in("runtime_top_p_reset_ids", "TYPE_INT32", [1], *_SCALAR),
    _in("len_penalty", "TYPE_FP32", [1], *_SCALAR),
    _in("early_stopping", "TYPE_BOOL", [1], *_SCALAR),
    _in("repetition_penalty", "TYPE_FP32", [1], *_SCALAR),
    _in("min_tokens", "TYPE_INT32", [1], *_SCALAR),
    _in("beam_search_diversity_rate", "TYPE_FP32", [1], *_SCALAR),
    _in("presence_penalty", "TYPE_FP32", [1], *_SCALAR),
    _in("frequency_penalty", "TYPE_FP32", [1], *_SCALAR),
    _in("seed", "TYPE_UINT64", [1], *_SCALAR),
    _in("return_log_probs", "TYPE_BOOL", [1], *_SCALAR),
    _in("return_context_logits", "TYPE_BOOL", [1], *_SCALAR),
    _in("return_generation_logits", "TYPE_BOOL", [1], *_SCALAR),
    _in("return_perf_metrics", "TYPE_BOOL", [1], *_SCALAR),
    _in("return_num_input_tokens", "TYPE_BOOL", [1], *_SCALAR),
    _in("return_num_output_tokens", "TYPE_BOOL", [1], *_SCALAR),
    _in("exclude_input_in_output", "TYPE_BOOL", [1], *_SCALAR),
    _in("stop", "TYPE_BOOL", [1], *_SCALAR),
    _in("streaming", "TYPE_BOOL", [1], *_SCALAR),
    _in("prompt_embedding_table", "${prompt_embedding_table_data_type}", [-1, -1], "opt", "ragged"),
    _in("prompt_table_extra_ids", "TYPE_UINT64", [-1], "opt", "ragged"),
    _in("prompt_vocab_size", "TYPE_INT32", [1], *_SCALAR),
    _in("cross_attention_mask", "TYPE_BOOL", [-1, -1], "opt", "ragged", scope="multimodal"),
    _in("mrope_rotary_cos_sin", "TYPE_FP32", [-1], "opt", scope="multimodal"),
    _in("mrope_position_deltas", "TYPE_INT64", [1], "opt", scope="multimodal"),
    _in("lora_task_id", "TYPE_UINT64", [1], *_SCALAR),
    _in("lora_weights", "TYPE_FP16", [-1, -1], "opt", "ragged"),
    _in("lora_config", "TYPE_INT32", [-1, 3], "opt", "ragged"),
    _in("context_phase_params", "TYPE_UINT8", [-1], "opt", "ragged"),
    _in("skip_cross_attn_blocks", "TYPE_BOOL", [1], "opt", "ragged", scope="multimodal"),
    _in("retention_token_range_starts", "TYPE_INT32", [-1], "opt", "ragged"),
    _in("retention_token_range_ends", "TYPE_INT32", [-1], "opt", "ragged"),
    _in("retention_token_range_priorities", "TYPE_INT32", [-1], "opt", "ragged"),
    _in("retention_token_range_durations_ms", "TYPE_INT32", [-1], "opt", "ragged"),
    _in("retention_decode_priority", "TYPE_INT32", [1], "opt", "ragged"),
    _in("retention_decode_duration_ms", "TYPE_INT32", [1], "opt", "ragged"),
    _in("guided_decoding_guide_type", "TYPE_STRING", [1], "opt", "ragged"),
    _in("guided_decoding_guide", "TYPE_STRING", [1], "opt", "ragged"),
    _in("lookahead_window_size", "TYPE_INT32", [1], "opt", "ragged"),
    _in("lookahead_ngram_size", "TYPE_INT32", [1], "opt", "ragged"),
    _in("lookahead_verification_set_size", "TYPE_INT32", [1], "opt", "ragged"),
)


def _out(name, dtype, dims, scope="decoder", source=TRTLLM_TEMPLATE):
    return Tensor(name, dtype, tuple(dims), scope=scope, source=source)


# tensorrt_llm outputs, in template order.
TRTLLM_OUTPUTS: tuple[Tensor, ...] = (
    _out("output_ids", "TYPE_INT32", [-1, -1]),
    _out("sequence_length", "TYPE_INT32", [-1]),
    _out("cum_log_probs", "TYPE_FP32", [-1]),
    _out("output_log_probs", "TYPE_FP32", [-1, -1]),
    _out("context_logits", "${logits_datatype}", [-1, -1]),
    _out("generation_logits", "${logits_datatype}", [-1, -1, -1]),
    _out("batch_index", "TYPE_INT32", [1]),
    _out("sequence_index", "TYPE_INT32", [1]),
    _out("context_phase_params", "TYPE_UINT8", [-1]),
    _out("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
    _out("kv_cache_reused_blocks", "TYPE_INT32", [1]),
    _out("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    _out("arrival_time_ns", "TYPE_INT64", [1]),
    _out("first_scheduled_time_ns", "TYPE_INT64", [1]),
    _out("first_token_time_ns", "TYPE_INT64", [1]),
    _out("last_token_time_ns", "TYPE_INT64", [1]),
    _out("acceptance_rate", "TYPE_FP32", [1]),
    _out("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    _out("total_draft_tokens", "TYPE_INT32", [1]),
    _out("num_input_tokens", "TYPE_INT32", [1]),
    _out("num_output_tokens", "TYPE_INT32", [1]),
)


def _pre(name, dtype, dims, optional=False, scope="decoder"):
    return Tensor(name, dtype, tuple(dims), optional, scope=scope, source=PREPROCESSING_TEMPLATE)


# preprocessing inputs and outputs, in template order (no reshape, no ragged batching on any of them).
PREPROCESSING_INPUTS: tuple[Tensor, ...] = (
    _pre("QUERY", "TYPE_STRING", [1]),
    _pre("DECODER_QUERY", "TYPE_STRING", [1], True, scope="enc-dec"),
    _pre("IMAGE_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], True, scope="multimodal"),
    _pre("IMAGE_URL", "TYPE_STRING", [-1], True, scope="multimodal"),
    _pre("IMAGE_SIZES", "TYPE_INT64", [-1, 2], True, scope="multimodal"),
    _pre("VIDEO_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], True, scope="multimodal"),
    _pre("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
    _pre("BAD_WORDS_DICT", "TYPE_STRING", [-1], True),
    _pre("STOP_WORDS_DICT", "TYPE_STRING", [-1], True),
    _pre("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], True),
    _pre("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], True),
    _pre("END_ID", "TYPE_INT32", [1], True),
    _pre("PAD_ID", "TYPE_INT32", [1], True),
    _pre("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", [1], True),
)
PREPROCESSING_OUTPUTS: tuple[Tensor, ...] = (
    _pre("INPUT_ID", "TYPE_INT32", [-1]),
    _pre("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
    _pre("DECODER_INPUT_ID", "TYPE_INT32", [-1]),
    _pre("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", [1]),
    _pre("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]),
    _pre("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]),
    _pre("EMBEDDING_BIAS", "TYPE_FP32", [-1]),
    _pre("REQUEST_OUTPUT_LEN", "TYPE_INT32", [-1]),
    _pre("OUT_END_ID", "TYPE_INT32", [1]),
    _pre("OUT_PAD_ID", "TYPE_INT32", [1]),
    _pre("OUT_PROMPT_TABLE_EXTRA_IDS", "TYPE_UINT64", [-1]),
    _pre("PIXEL_VALUES", "TYPE_FP16", [-1, -1, -1, -1]),
    _pre("ASPECT_RATIO_IDS", "TYPE_INT64", [-1]),
    _pre("ASPECT_RATIO_MASK", "TYPE_INT64", [-1, -1]),
    _pre("CROSS_ATTENTION_MASK", "TYPE_INT64", [-1, -1, -1]),
    _pre("IMAGE_SIZES", "TYPE_INT64", [-1, 2]),
    _pre("IS_VIDEO_INPUT", "TYPE_BOOL", [1]),
    _pre("ATTENTION_MASK", "TYPE_INT64", [-1]),
    _pre("IMAGE_GRID_THW", "TYPE_INT64", [3]),
    _pre("VISION_INPUT_ID", "TYPE_INT32", [-1]),
)
# preprocessing parameters the template declares (upstream's model.py looks up multimodal_model_path
# unconditionally, so a config without it does not load upstream's model).
PREPROCESSING_PARAMETERS = (
    ("tokenizer_dir", "add_special_tokens", "multimodal_model_path", "gpt_model_path", "max_num_images"),
    PREPROCESSING_TEMPLATE,
)

# Values of the template placeholders: Triton dtype of each engine dtype string.
TRITON_DTYPE = {"float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "float32": "TYPE_FP32"}


def declared(rows: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The rows a decoder-only LLM repository declares."""
    return tuple(r for r in rows if r.scope == "decoder")
