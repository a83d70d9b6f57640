"""What the Triton twin ``tensorrt_llm`` model needs from the library: settings from its config, request tensors
to executor requests, responses to output tensors, and the backend's Prometheus metric families.

The model file (``model_repo/tensorrt_llm/1/model.py``) only moves tensors between Triton and these functions,
so everything here runs and is tested without Triton. Semantics are the ``tensorrtllm`` backend's: request
inputs and defaults (``end_id`` unset means no end id; ``top_k`` 1 or ``top_k`` 0 with ``top_p`` 0 is greedy),
per-request outputs (``output_ids`` [1, 1, L], ``sequence_length`` [1, 1], perf metrics when asked;
``return_log_probs`` adds ``cum_log_probs`` [1, 1] and ``output_log_probs`` [1, 1, L] of the output tokens this
response carries, as upstream's python ``tensorrt_llm`` model shapes them: ``convert_response`` in
NVIDIA/TensorRT-LLM ``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py``
@0d5352f5fc5f39ee2eaed948e67236e64ff68e2a; the values are the executor's raw-logit logprobs,
:mod:`trtpipe.serving.logprobs`, and which distribution the C++ engine path's sampler returns was not confirmed),
and the metric families and labels of the 1.x backend.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from trtpipe.serving.draft_logits import check_draft_logits
from trtpipe.serving.api import CapacityPolicy, ExecutorConfig, Request, Response, SamplingParams
from trtpipe.serving.config import KV_REUSE_DEFAULT, executor_config, read_twin_extras
from trtpipe.serving.executor import IterationStats
from trtpipe.serving.lookahead import executor_knobs as lookahead_knobs, request_sizes
from trtpipe.serving import request_checks
from trtpipe.recipe.lookahead import TRITON_PARAMETERS as LOOKAHEAD_PARAMETERS
from trtpipe.triton.upstream_io import TWIN_EXTRAS_PARAMETER
from trtpipe.triton.xgrammar_info import TOKENIZER_INFO_FILE
from trtpipe.jsonfile import load_json

_TRUE = {"true", "1", "t", "y", "yes"}


def param(params: dict, key: str, default=None):
    """A config.pbtxt parameter; empty or an unfilled ``${...}`` template value means "not set"."""
    value = params.get(key, {}).get("string_value", "")
    return default if value == "" or value.startswith("${") else value


def _flag(params: dict, key: str, default: bool) -> bool:
    return str(param(params, key, str(default))).lower() in _TRUE


@dataclass(frozen=True)
class TwinSettings:
    """Everything the twin reads at load time."""

    engine_dir: Path
    executor: ExecutorConfig
    exclude_input_default: bool
    default_end_id: Optional[int]
    cpu_threads: int
    vocab_size: int
    static_batching: bool = False
    xgrammar_tokenizer_info: Optional[Path] = None  # the file xgrammar_tokenizer_info_path names (guided decoding)


def _default_end_id(path: Path) -> Optional[int]:
    """The first EOS id of generation_config.json (the ensemble's preprocessing always sends end_id)."""
    try:
        eos = load_json(path).get("eos_token_id")
    except (OSError, ValueError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return int(eos) if isinstance(eos, int) else None


def settings_from_model_config(model_config: dict, model_repository: str) -> TwinSettings:
    """Engine limits from the engine's config.json, executor knobs from the model's parameters (as the backend).

    The KV pool holds ``max_tokens_in_paged_kv_cache`` tokens when set (the rules of
    :mod:`trtpipe.serving.config`); the knobs without an upstream parameter come in one JSON parameter,
    ``executor_extras``.
    """
    params = model_config.get("parameters", {})
    engine = param(params, "gpt_model_path")
    if engine is None:
        raise ValueError("tensorrt_llm twin: parameter gpt_model_path is not set")
    engine_dir = Path(engine if os.path.isabs(engine) else os.path.join(model_repository, engine))
    cfg = load_json(engine_dir / "config.json")
    build = cfg.get("build_config", {})
    pretrained = cfg.get("pretrained_config", {})
    tpb = int((build.get("plugin_config") or {}).get("tokens_per_block") or 32)
    max_batch, max_seq = int(build.get("max_batch_size", 8)), int(build.get("max_seq_len", 2048))
    max_tokens = param(params, "max_tokens_in_paged_kv_cache")
    policy = str(param(params, "batch_scheduler_policy", "guaranteed_no_evict")).lower()
    # static_batch is the executor's kSTATIC_BATCH, which the real backend does not accept (it warns and keeps the
    # default): the twin takes it so a benchmark can compare against static batching with streaming left on.
    if policy not in [p.value for p in CapacityPolicy]:
        policy = CapacityPolicy.GUARANTEED_NO_EVICT.value  # the backend warns and keeps the default
    static = str(param(params, "gpt_model_type", "inflight_fused_batching")).lower() == "v1"
    if static:  # V1: a batch runs to completion before the next forms; no streaming, input excluded
        policy = CapacityPolicy.STATIC_BATCH.value
    queue = ((model_config.get("dynamic_batching") or {}).get("default_queue_policy") or {}).get("max_queue_size", 0)
    executor = executor_config(
        max_batch_size=max_batch,
        max_num_tokens=int(build.get("max_num_tokens") or max_batch * int(build.get("max_input_len", max_seq))),
        max_input_len=int(build.get("max_input_len", max_seq)),
        max_seq_len=max_seq,
        kv_tokens=int(max_tokens) if max_tokens is not None else None,
        tokens_per_block=tpb,
        capacity_policy=policy,
        enable_chunked_context=_flag(params, "enable_chunked_context", False),
        enable_kv_cache_reuse=_flag(params, "enable_kv_cache_reuse", KV_REUSE_DEFAULT),
        max_queue_size=int(queue or 0),
        guided_decoding_backend=param(params, "guided_decoding_backend") or None,
        # decoding_mode lookahead: the executor's (W, N, G) from the lookahead_* parameters, as the backend reads them
        **lookahead_knobs(
            param(params, "decoding_mode"),
            {k: param(params, k) for k in LOOKAHEAD_PARAMETERS},
            int(build.get("max_draft_len") or 0),
        ),
        **read_twin_extras(param(params, TWIN_EXTRAS_PARAMETER)),  # the twin's own knobs (request_timeout_s, ...)
    )
    for key in ("medusa_choices", "eagle_choices"):  # the tree the twin's heads draft (a chain or with siblings)
        if param(params, key):
            from dataclasses import replace

            from trtpipe.serving.medusa import check_choices

            tree = check_choices(str(param(params, key)), executor, key)
            if key == "medusa_choices":  # Medusa's tree comes from the parameter; EAGLE's is the recipe's, checked
                executor = replace(executor, medusa_choices=tree)
    return TwinSettings(
        engine_dir=engine_dir,
        executor=executor,
        exclude_input_default=_flag(params, "exclude_input_in_output", False),
        default_end_id=_default_end_id(engine_dir / "checkpoint" / "generation_config.json"),
        cpu_threads=int(param(params, "cpu_threads", "1")),
        vocab_size=int(pretrained.get("vocab_size") or 0),
        static_batching=static,
        xgrammar_tokenizer_info=_tokenizer_info_file(params, model_repository),
    )


def _tokenizer_info_file(params: dict, model_repository: str) -> Optional[Path]:
    """``xgrammar_tokenizer_info_path`` (absolute, as the repository writes it), else the copy beside the model when
    the repository was moved (as ``tokenizer_dir`` falls back), else None."""
    path = param(params, "xgrammar_tokenizer_info_path")
    if not path:
        return None
    p = Path(path if os.path.isabs(path) else os.path.join(model_repository, path))
    beside = Path(model_repository) / TOKENIZER_INFO_FILE
    return p if p.exists() or not beside.exists() else beside


def guided_decoder(s: TwinSettings):
    """The executor's guided decoding, as the backend builds it: ``guided_decoding_backend`` with the tokenizer
    information of ``xgrammar_tokenizer_info_path`` (None when the backend parameter is empty)."""
    from trtpipe.serving.guided import GuidedDecoder

    backend = s.executor.guided_decoding_backend
    if not backend:
        return None
    if s.xgrammar_tokenizer_info is None or not s.xgrammar_tokenizer_info.exists():
        raise ValueError(
            f"tensorrt_llm twin: guided_decoding_backend is {backend!r} but xgrammar_tokenizer_info_path "
            f"({s.xgrammar_tokenizer_info or 'unset'}) names no file"
        )
    info = load_json(s.xgrammar_tokenizer_info)
    return GuidedDecoder(backend, info, s.vocab_size)


def _scalar(get: Callable[[str], Optional[np.ndarray]], name: str, default, kind):
    a = get(name)
    if a is None or a.size == 0:
        return default
    return kind(a.reshape(-1)[0])


@dataclass
class ParsedRequest:
    request: Request
    return_perf_metrics: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    stop: bool
    return_log_probs: bool = False

    @property
    def wants_outputs_at_end(self) -> bool:
        """Whether the final response carries tensors even with no new tokens."""
        return self.return_perf_metrics or self.return_num_input_tokens or self.return_num_output_tokens


def twin_adapters(model_config: dict, model_repository: str, s: TwinSettings):
    """The twin's LoRA tasks (:class:`trtpipe.serving.triton_lora.TwinAdapters`) when its engine was built with
    LoRA, else None."""
    from trtpipe.serving.triton_lora import from_parameters

    params = model_config.get("parameters", {})
    prefetch, host = param(params, "lora_prefetch_dir"), param(params, "lora_cache_host_memory_bytes")
    return from_parameters(s.engine_dir, model_repository, prefetch, host, s.executor.max_loras)


def parse_request(
    get: Callable[[str], Optional[np.ndarray]], s: TwinSettings, decoupled: bool, adapters=None
) -> ParsedRequest:
    """Request tensors (``get(name)`` -> numpy or None) to an executor :class:`Request`; ValueError names the input.
    ``adapters``: the engine's LoRA tasks (:func:`twin_adapters`; None: built without LoRA)."""
    from trtpipe.serving.triton_lora import select
    from trtpipe.serving.twin_input_policy import refusal

    if _scalar(get, "stop", False, bool):
        return ParsedRequest(Request([], 0), False, False, False, True)
    why = refusal(get)  # declared like the real model's inputs, but not computed by the reference runtime
    if why:
        raise ValueError(why)
    ids = get("input_ids")
    if ids is None:
        raise ValueError("input_ids is missing")
    if ids.dtype != np.int32:
        raise ValueError(f"input_ids must be INT32, got {ids.dtype}")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"the CPU twin takes one sequence per request, got a batch of {ids.shape[0]}")
    ids = ids.reshape(-1)
    in_len = _scalar(get, "input_lengths", ids.size, int)
    if in_len < 1 or ids.size == 0:
        raise ValueError("input_ids is empty: the prompt has no tokens")
    if in_len > ids.size:
        raise ValueError(f"input_lengths {in_len} is larger than input_ids ({ids.size} tokens)")
    prompt = ids[:in_len]
    vocab = s.vocab_size or (1 << 31)
    request_checks.check_token_ids(prompt, vocab)  # a bad id must fail this request, not the batched step
    if in_len > s.executor.max_input_len:
        raise ValueError(f"prompt of {in_len} tokens exceeds the engine's max_input_len {s.executor.max_input_len}")
    out_len = _scalar(get, "request_output_len", None, int)
    if out_len is None:
        raise ValueError("request_output_len (max_tokens) is missing")
    if out_len < 1:
        raise ValueError(f"request_output_len (max_tokens) must be at least 1, got {out_len}")
    if request_checks.word_lists(get("bad_words_list"), "bad_words_list", vocab):
        raise ValueError("bad_words_list is not supported by the CPU twin (the TensorRT engine supports it)")
    end_id = _scalar(get, "end_id", s.default_end_id, int)
    if end_id is not None and end_id < 0:
        end_id = None  # -1: no end id
    if end_id is not None and s.vocab_size and end_id >= s.vocab_size:
        raise ValueError(f"end_id {end_id} is outside the vocabulary [0, {s.vocab_size})")
    temperature = _scalar(get, "temperature", 1.0, float)
    top_k = _scalar(get, "runtime_top_k", 0, int)
    top_p = _scalar(get, "runtime_top_p", 0.0, float)
    seed = _scalar(get, "seed", None, int)
    request_checks.check_sampling(temperature, top_k, top_p, seed)
    greedy = top_k == 1 or (top_k == 0 and top_p == 0.0) or temperature == 0.0
    sampling = (
        SamplingParams(0.0, 0, 1.0, None)
        if greedy
        else SamplingParams(temperature, top_k, 1.0 if top_p == 0.0 else top_p, seed)
    )
    streaming = _scalar(get, "streaming", False, bool) and not s.static_batching
    if streaming and not decoupled:
        raise ValueError("streaming needs the decoupled tensorrt_llm model (recipe triton.streaming: true)")
    min_tokens = _scalar(get, "min_tokens", 0, int)  # SamplingConfig minTokens: values < 1 have no effect
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    return_log_probs = _scalar(get, "return_log_probs", False, bool)
    priority = _scalar(get, "priority", 0.5, float)
    if not 0.0 <= priority <= 1.0:
        raise ValueError(f"priority must be within [0, 1], got {priority}")
    drafts = _drafts(get, out_len, vocab)
    given_logits = _given(get, "draft_logits")  # the BLS's use_draft_logits (trtpipe/serving/draft_logits.py)
    draft_logits = None if given_logits is None else check_draft_logits(given_logits, len(drafts), vocab)
    guide = _guide(get)
    lora = select(adapters, *(_given(get, n) for n in ("lora_task_id", "lora_weights", "lora_config")))
    request = Request(
        prompt=[int(t) for t in prompt],
        max_new_tokens=out_len,
        end_id=end_id,
        stop_words=[w for w in request_checks.word_lists(get("stop_words_list"), "stop_words_list", vocab) if w],
        sampling=sampling,
        streaming=streaming,
        exclude_input_from_output=s.static_batching
        or _scalar(get, "exclude_input_in_output", s.exclude_input_default, bool),
        priority=priority,
        return_perf_metrics=_scalar(get, "return_perf_metrics", False, bool),
        guide=guide,
        logprobs=0 if return_log_probs else None,
        min_tokens=min_tokens,
        lora=lora,
        draft_tokens=drafts,
        lookahead=request_sizes(get),
        draft_logits=draft_logits,
        return_generation_logits=_scalar(get, "return_generation_logits", False, bool),
    )
    return ParsedRequest(
        request,
        request.return_perf_metrics,
        _scalar(get, "return_num_input_tokens", False, bool),
        _scalar(get, "return_num_output_tokens", False, bool),
        False,
        return_log_probs,
    )


def _drafts(get: Callable[[str], Optional[np.ndarray]], out_len: int, vocab: int) -> list[int]:
    """``draft_input_ids``: the tokens a draft model proposed to follow the prompt (upstream's BLS sends them with
    ``request_output_len`` = drafts + 1, ``tensorrt_llm_bls/1/lib/triton_decoder.py@07f3e442``)."""
    a = _given(get, "draft_input_ids")
    if a is None:
        return []
    if a.dtype != np.int32:
        raise ValueError(f"draft_input_ids must be INT32, got {a.dtype}")
    d = a.reshape(-1)
    request_checks.check_token_ids(d, vocab, "draft_input_ids")
    if d.size >= out_len:
        raise ValueError(f"draft_input_ids: {d.size} drafts need request_output_len >= {d.size + 1}, got {out_len}")
    return [int(t) for t in d]


def _given(get: Callable[[str], Optional[np.ndarray]], name: str) -> Optional[np.ndarray]:
    a = get(name)
    return a if a is not None and a.size else None


def _text(get: Callable[[str], Optional[np.ndarray]], name: str) -> Optional[str]:
    a = get(name)
    if a is None or a.size == 0:
        return None
    v = a.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _guide(get: Callable[[str], Optional[np.ndarray]]):
    """``guided_decoding_guide_type`` / ``guided_decoding_guide`` (tensorrtllm_backend docs/guided_decoding.md) as the
    executor's guide; None without a type. A bad type is a ValueError naming the valid ones."""
    from trtpipe.serving.guided import Guide

    kind = _text(get, "guided_decoding_guide_type")
    return None if kind is None else Guide.of(kind, _text(get, "guided_decoding_guide"))


def response_outputs(resp: Response, parsed: ParsedRequest) -> list[tuple[str, np.ndarray]]:
    """Output tensors of one response, as the backend names and shapes them."""
    out = [
        ("output_ids", np.array(resp.tokens, np.int32).reshape(1, 1, len(resp.tokens))),
        ("sequence_length", np.array([[len(resp.tokens)]], np.int32)),
    ]
    if parsed.return_log_probs and resp.logprobs is not None:
        values = [x.logprob for x in resp.logprobs]
        out += [
            ("cum_log_probs", np.array([[resp.cum_log_prob or 0.0]], np.float32)),
            ("output_log_probs", np.array(values, np.float32).reshape(1, 1, len(values))),
        ]
    if resp.generation_logits:  # [batch 1, beam 1, tokens, vocab], as the backend returns them
        rows = np.stack([np.asarray(x, np.float32) for x in resp.generation_logits])
        out.append(("generation_logits", rows.reshape(1, 1, *rows.shape)))
    if resp.is_final and parsed.return_perf_metrics and resp.perf is not None:
        p = resp.perf
        out += [
            (name, np.array([value], dtype))
            for name, value, dtype in (
                ("arrival_time_ns", p.arrival_ns, np.int64),
                ("first_scheduled_time_ns", p.first_scheduled_ns, np.int64),
                ("first_token_time_ns", p.first_token_ns, np.int64),
                ("last_token_time_ns", p.last_token_ns, np.int64),
                ("kv_cache_alloc_new_blocks", p.kv_alloc_new_blocks, np.int32),
                ("kv_cache_reused_blocks", p.kv_reused_blocks, np.int32),
                ("kv_cache_alloc_total_blocks", p.kv_alloc_total_blocks, np.int32),
                ("acceptance_rate", p.acceptance_rate, np.float32),
                ("total_accepted_draft_tokens", p.total_accepted_draft_tokens, np.int32),
                ("total_draft_tokens", p.total_draft_tokens, np.int32),
            )
        ]
    if resp.is_final and parsed.return_num_input_tokens:
        out.append(("num_input_tokens", np.array([resp.num_input_tokens], np.int32)))
    if resp.is_final and parsed.return_num_output_tokens:
        out.append(("num_output_tokens", np.array([resp.num_output_tokens], np.int32)))
    return out


# ---- Prometheus: the 1.x backend's families (custom_metrics_reporter.cc) ------------------------------
GAUGES = {
    "nv_trt_llm_request_metrics": ("request_type", "TRT LLM request metrics"),
    "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type", "TRT LLM KV cache block metrics"),
    "nv_trt_llm_inflight_batcher_metrics": (
        "inflight_batcher_specific_metric",
        "TRT LLM inflight_batcher-specific metrics",
    ),
    "nv_trt_llm_general_metrics": ("general_type", "General TRT LLM metrics"),
}
HISTOGRAMS = {
    "nv_llm_input_token_len": ("response_metric_type", "total_input_tokens", "TRT LLM response input token length"),
    "nv_llm_output_token_len": ("response_metric_type", "total_output_tokens", "TRT LLM response output token length"),
}
TOKEN_BUCKETS = [10, 50, 100, 500, 1000]


ITER_STATS_ENV = "TRTPIPE_ITER_STATS"  # a file: the twin appends one JSON line per executor iteration


def iteration_record(stats: IterationStats) -> dict:
    """One iteration as TensorRT-LLM's executor serializes ``IterationStats`` (its JSON field names), plus the
    twin's ``numAttendedTokens`` and ``scheduledEntries`` ([start position, tokens, is context] per scheduled
    request): what a step-cost model of the twin is fitted on."""
    kv = stats.kv
    return {
        "iter": stats.iteration,
        "timestamp": stats.timestamp_ns,  # the executor clock (monotonic ns): differences only
        "iterLatencyMS": stats.step_time_s * 1e3,
        "numActiveRequests": stats.num_active,
        "numQueuedRequests": stats.num_queued,
        "maxNumActiveRequests": stats.max_active,
        "kvCacheStats": {
            "maxNumBlocks": kv.max_blocks,
            "freeNumBlocks": kv.free_blocks,
            "usedNumBlocks": kv.used_blocks,
            "tokensPerBlock": kv.tokens_per_block,
            "reusedBlocks": kv.reused_blocks,
        },
        "inflightBatchingStats": {
            "numScheduledRequests": stats.num_scheduled,
            "numContextRequests": stats.num_context_requests,
            "numGenRequests": stats.num_generation_requests,
            "numPausedRequests": stats.num_paused,
            "numCtxTokens": stats.num_context_tokens,
            "microBatchId": 0,
        },
        "numAttendedTokens": stats.num_attended_tokens,
        "scheduledEntries": [[start, n, int(ctx)] for start, n, ctx in stats.entries],
    }


class IterationLog:
    """Appends the executor's new iteration records to a JSON-lines file (``TRTPIPE_ITER_STATS``)."""

    def __init__(self, path: str):
        self.fh = open(path, "a", buffering=1)
        self.last = -1

    def write_new(self, history) -> int:
        """Write the records of ``history`` (the executor's bounded deque) newer than the last call's."""
        records = [r for r in list(history) if r.iteration > self.last]  # list(): one atomic copy
        for r in records:
            self.fh.write(json.dumps(iteration_record(r)) + "\n")
        if records:
            self.last = records[-1].iteration
        return len(records)

    def close(self) -> None:
        self.fh.close()


def gauge_values(stats: IterationStats) -> dict[tuple[str, str], float]:
    """(family, category label value) -> value, from the last iteration record."""
    kv = stats.kv
    return {
        ("nv_trt_llm_request_metrics", "active"): stats.num_active,
        ("nv_trt_llm_request_metrics", "max"): stats.max_active,
        ("nv_trt_llm_request_metrics", "scheduled"): stats.num_scheduled,
        ("nv_trt_llm_request_metrics", "context"): stats.num_context_requests,
        ("nv_trt_llm_request_metrics", "waiting"): stats.num_waiting,
        ("nv_trt_llm_kv_cache_block_metrics", "max"): kv.max_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "free"): kv.free_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "used"): kv.used_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): kv.tokens_per_block,
        ("nv_trt_llm_kv_cache_block_metrics", "reused"): kv.reused_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "fraction"): kv.fraction_used,
        ("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens"): stats.num_context_tokens,
        ("nv_trt_llm_inflight_batcher_metrics", "generation_requests"): stats.num_generation_requests,
        ("nv_trt_llm_inflight_batcher_metrics", "micro_batch_id"): 0,
        ("nv_trt_llm_inflight_batcher_metrics", "paused_requests"): stats.num_paused,
        ("nv_trt_llm_general_metrics", "iteration_counter"): stats.iteration,
        ("nv_trt_llm_general_metrics", "timestamp"): time.time_ns() // 1000,  # µs since epoch, as the 1.x backend
    }
