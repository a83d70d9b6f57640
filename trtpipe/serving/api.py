"""The executor's vocabulary: requests, responses, per-step batches and the step-engine interface.

Names follow TensorRT-LLM's C++ executor (``Request``, ``Response``, ``FinishReason``, ``RequestPerfMetrics``,
``CapacitySchedulerPolicy``) so that a reader of its docs finds the same ideas here. Everything in this module is
plain data; the behaviour lives in :mod:`trtpipe.serving.kv_pool`, :mod:`trtpipe.serving.scheduler` and
:mod:`trtpipe.serving.executor`.

A step engine is what the executor runs each iteration: the reference runtime on CPU (real tokens, measured time),
the same runtime split over ``mpirun`` ranks, or a cost model in simulated time. The executor owns scheduling and
the KV block tables; the engine owns the KV storage those tables index into.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from trtpipe.serving.logprobs import TokenLogprob


class FinishReason(enum.IntEnum):
    """executor ``FinishReason`` values, as the backend reports them."""

    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class CapacityPolicy(str, enum.Enum):
    """executor ``CapacitySchedulerPolicy`` (Triton ``batch_scheduler_policy`` spells the first two)."""

    MAX_UTILIZATION = "max_utilization"
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    STATIC_BATCH = "static_batch"


DEFAULT_PRIORITY = 0.5  # executor Request::kDefaultPriority (bigger is served first)


class ErrorKind(str, enum.Enum):
    """Why a request failed, so each front end answers with its own status (HTTP 400/429/504/500, Triton error).

    ``OVERLOADED``: refused or shed because the queue is full (retry later); ``TIMED_OUT``: not finished within its
    allotted time; ``INVALID``: the request itself is out of range; ``INTERNAL``: a failure in the executor or step.
    """

    INVALID = "invalid"
    OVERLOADED = "overloaded"
    TIMED_OUT = "timed_out"
    INTERNAL = "internal"


@dataclass(frozen=True)
class ExecutorConfig:
    """The engine limits and executor knobs that decide scheduling (engine build_config + Triton parameters)."""

    max_batch_size: int
    max_num_tokens: int
    max_input_len: int
    max_seq_len: int
    num_blocks: int
    tokens_per_block: int = 64
    capacity_policy: CapacityPolicy = CapacityPolicy.GUARANTEED_NO_EVICT
    enable_chunked_context: bool = False
    enable_kv_cache_reuse: bool = False
    max_queue_size: int = 0  # 0: unlimited
    max_beam_width: int = 1
    request_timeout_s: float = 0.0  # a request not finished this long after submit fails (0: no limit)
    guided_decoding_backend: Optional[str] = None  # "xgrammar" | "llguidance" | None (guided decoding off)
    max_loras: int = 0  # LoRA adapters one step may hold (the device cache, trtpipe.serving.adapters); 0: no limit
    # speculative decoding (trtpipe.serving.speculative): "" off, "NGram", "DraftTarget", "MTP", "Eagle3", "Medusa",
    # "Eagle" or "Lookahead" (speculative_config names; MTP, Eagle3, Medusa and Eagle draft from the target's hidden
    # states: hidden_draft, medusa, eagle1; Medusa drafts the tree medusa_choices, or the chain of max_draft_len heads
    # [[0], [0, 0], ...]; Eagle (EAGLE-1/2) the chain or static tree of eagle_choices)
    speculative_decoding_type: str = ""
    max_draft_len: int = 0
    max_matching_ngram_size: int = 2
    speculative_model: str = ""  # DraftTarget: the draft's HF directory; Eagle3: the head's (the front end loads it)
    # "Lookahead": the executor's LookaheadDecodingConfig (W, N, G; 0: off), the Triton model's lookahead_* parameters
    # (trtpipe.serving.lookahead; max_draft_len is its (N - 2) + (W - 1 + G) * (N - 1))
    lookahead_window_size: int = 0
    lookahead_ngram_size: int = 0
    lookahead_verification_set_size: int = 0
    medusa_choices: Optional[Sequence[Sequence[int]]] = None  # Medusa's tree (None: the chain of max_draft_len)
    eagle_choices: str = ""  # Eagle, Eagle3: the draft tree in Triton's brace format ("{0}, {0, 0}"; "": the chain)
    # Eagle3's dynamic tree (EAGLE-2, trtpipe.serving.dynamic_tree): children per expanded node (0: off) and the
    # tree's depth (upstream's max_draft_len); max_draft_len is then its draft tokens (max_total_draft_tokens)
    dynamic_tree_max_top_k: int = 0
    dynamic_tree_depth: int = 0

    @property
    def draft_reserve(self) -> int:
        """Positions each generating request may add beyond its one token per step (scheduling reserves them)."""
        return self.max_draft_len if self.speculative_decoding_type else 0

    @property
    def max_context_length(self) -> int:
        """microBatchScheduler's cap on one context (engines here always have context FMHA: max_num_tokens)."""
        return self.max_num_tokens


UINT64_MAX = (1 << 64) - 1  # TensorRT-LLM's SamplingConfig.randomSeed is a uint64


def sampling_problem(
    temperature: float,
    top_k: int,
    top_p: float,
    seed: Optional[int],
    names: tuple[str, str, str, str] = ("temperature", "top_k", "top_p", "seed"),
) -> Optional[str]:
    """The first sampling setting outside TensorRT-LLM's SamplingConfig ranges, as one line, or None.

    One check for every front end (each passes its own field names): a value that reaches a step unchecked (a NaN
    temperature, a seed torch cannot take) would fail the whole batch, or the executor loop itself.
    """
    t_name, k_name, p_name, s_name = names
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        return f"{t_name} must be a finite number >= 0, got {temperature!r}"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        return f"{k_name} must be >= 0, got {top_k!r}"
    if (
        isinstance(top_p, bool)
        or not isinstance(top_p, (int, float))
        or not math.isfinite(top_p)
        or not 0.0 <= top_p <= 1.0
    ):
        return f"{p_name} must be in [0, 1], got {top_p!r}"
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= UINT64_MAX):
        return f"{s_name} must be in [0, 2^64), got {seed!r}"
    return None


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0, top_k 1 or top_p 0 is greedy (as in TensorRT-LLM's ``params_imply_greedy_decoding``); a seed
    makes sampling repeatable per request."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or self.top_p <= 0.0

    def problem(self) -> Optional[str]:
        """What is out of range (one line), or None: see :func:`sampling_problem`."""
        return sampling_problem(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class Request:
    """One generation request, as a front end hands it to :meth:`Executor.submit`."""

    prompt: Sequence[int]
    max_new_tokens: int
    end_id: Optional[int] = None
    stop_words: Sequence[Sequence[int]] = ()
    sampling: SamplingParams = SamplingParams()
    streaming: bool = False
    exclude_input_from_output: bool = False
    priority: float = DEFAULT_PRIORITY
    return_perf_metrics: bool = False
    client_tag: Any = None  # opaque to the executor (the front end's handle, e.g. a Triton response sender)
    allotted_time_s: Optional[float] = None  # executor ``allottedTimeMs``; None: the config's request_timeout_s
    guide: Any = None  # executor ``GuidedDecodingParams``: a trtpipe.serving.guided.Guide, or None
    lora: Optional[str] = None  # the LoRA adapter's name (None: the base model); KV prefix reuse is keyed by it
    # OutputConfig ``returnLogProbs`` as SamplingParams ``logprobs``: None off, k >= 0 the chosen token's logprob and
    # the top k; ``prompt_logprobs`` the same for every prompt position (trtpipe.serving.logprobs says which values)
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    min_tokens: int = 0  # SamplingConfig ``minTokens``: the end id cannot end the request before this many tokens
    # ``draft_input_ids`` (draft-target decoding with an external draft model, upstream's two-model form): tokens
    # proposed to follow the prompt, verified in the context step's forward (trtpipe.serving.speculative)
    draft_tokens: Sequence[int] = ()
    # the request's LookaheadDecodingConfig (W, N, G), at most the executor's; None: the executor's
    lookahead: Optional[tuple[int, int, int]] = None
    # ``draft_logits`` ([k, V], the draft model's generation logits of draft_tokens: upstream's BLS use_draft_logits):
    # the drafts are then verified by rejection sampling against them (trtpipe.serving.draft_logits)
    draft_logits: Any = None
    return_generation_logits: bool = False  # OutputConfig ``returnGenerationLogits``: each output token's logits


@dataclass
class PerfMetrics:
    """``RequestPerfMetrics``: steady-clock nanoseconds and KV block counters of one request."""

    arrival_ns: int = 0  # when the request left the executor queue (as in TensorRT-LLM)
    enqueue_ns: int = 0  # when submit() was called (trtpipe's addition: queue wait = arrival - enqueue)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    kv_alloc_total_blocks: int = 0
    kv_alloc_new_blocks: int = 0
    kv_reused_blocks: int = 0
    kv_missed_blocks: int = 0
    first_iter: int = -1
    last_iter: int = -1
    total_draft_tokens: int = 0  # speculative decoding: drafts proposed and verified
    total_accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (TensorRT-LLM's ``acceptance_rate`` output; 0 when none were proposed)."""
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class Response:
    """What the executor says about a request: new tokens (streaming) or the whole output (final), or an error.

    ``tokens`` is what the client should see in this response: for streaming the new tokens since the last
    response, otherwise (only at the end) prompt + output, or output alone with ``exclude_input_from_output``.
    """

    request_id: int
    tokens: list[int]
    is_final: bool
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    error: Optional[str] = None
    error_kind: Optional[ErrorKind] = None  # set with ``error``
    perf: Optional[PerfMetrics] = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    client_tag: Any = None
    # with Request.logprobs: one per output token of ``tokens`` (the prompt part of a final response has none)
    logprobs: Optional[list[TokenLogprob]] = None
    cum_log_prob: Optional[float] = None  # the sum of every output token's logprob so far
    # with Request.prompt_logprobs: one per prompt token, None for the first; on the first response only
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    generation_logits: Optional[list] = None  # with Request.return_generation_logits: [V] per output token so far

    @property
    def has_error(self) -> bool:
        return self.error is not None


@dataclass
class StepEntry:
    """One request's share of a step: ``tokens`` at positions ``start_pos``.. written through ``block_table``.

    Context entries carry a chunk of the prompt (the whole remaining prompt without chunking); generation
    entries carry the one token sampled last step. ``sample`` is true when this entry's last position must
    produce a token (the last context chunk, or any generation step).
    """

    request_id: int
    tokens: list[int]
    start_pos: int
    block_table: list[int]
    is_context: bool
    sample: bool
    sampling: SamplingParams = SamplingParams()
    generator: Any = None  # the request's own torch.Generator when sampling with a seed
    allowed: Any = None  # guided decoding: bool [V] tensor of the tokens this row may sample (None: all)
    lora: Optional[str] = None  # the request's LoRA adapter (None: the base model)
    logprobs: Optional[int] = None  # the sampled token's logprob and top k are wanted (Request.logprobs)
    prompt_logprobs: Optional[int] = None  # top k of each prompt target (Request.prompt_logprobs)
    prompt_targets: list[int] = field(default_factory=list)  # prompt tokens scored by this chunk's positions
    banned: Optional[int] = None  # a token the sampled row may not choose this step (min_tokens: the end id)
    # a generation entry with drafts carries [last token, d1..dk] and asks for k + 1 rows of logits;
    # draft_probs: the [k, V] distribution the drafts were drawn from (None: deterministic or greedy drafts)
    draft_probs: Any = None
    # a last context chunk with external drafts (Request.draft_tokens) ends with them: its last k + 1 positions are
    # [last prompt token, d1..dk] and ask for k + 1 rows of logits
    context_drafts: int = 0
    # drafts as a token set (trtpipe.serving.tree_verify): each token's position offset from start_pos (its RoPE
    # position), which new tokens each one sees ([n, n] bool; the cached prefix is always visible), and the candidate
    # paths acceptance walks (indices into tokens, the root left out; None: the tree the mask describes)
    spec_positions: Optional[list[int]] = None
    spec_mask: Any = None
    spec_paths: Optional[list[list[int]]] = None
    keep_logits: bool = False  # return the row the token was sampled from (Request.return_generation_logits)

    @property
    def verifies_drafts(self) -> bool:
        """A generation entry carrying drafts after its token, or a context chunk ending with external drafts
        (trtpipe.serving.speculative)."""
        return self.context_drafts > 0 if self.is_context else len(self.tokens) > 1

    @property
    def drafts(self) -> list[int]:
        """The drafts this entry verifies (none when it verifies none)."""
        if not self.verifies_drafts:
            return []
        return self.tokens[-self.context_drafts :] if self.is_context else self.tokens[1:]

    @property
    def sample_rows(self) -> int:
        """Logit rows a sampling entry is decided from: k + 1 when it verifies k drafts, else 1."""
        return len(self.drafts) + 1


@dataclass
class StepBatch:
    """One engine step: context entries first, then generation entries (``utils::sortRequests`` order)."""

    iteration: int
    entries: list[StepEntry] = field(default_factory=list)

    @property
    def num_context_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries if e.is_context)

    @property
    def num_generation_requests(self) -> int:
        return sum(1 for e in self.entries if not e.is_context)


@dataclass
class StepResult:
    """Sampled token per entry that asked for one, and how long the step took (measured or simulated).

    ``errors``: one line per entry whose own row failed (e.g. its sampling); the executor fails those requests
    alone and accepts every other entry's token. ``accepted``: the tokens of each entry that verified drafts.
    """

    tokens: dict[int, int]
    elapsed_s: float
    errors: dict[int, str] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # the sampled token's, where the entry asked
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)  # one per prompt target
    accepted: dict[int, list[int]] = field(default_factory=dict)  # entries with drafts: every token they emit
    # masked entries (spec_mask): the accepted drafts' indices into the entry's tokens, whose KV the executor keeps
    kept: dict[int, list[int]] = field(default_factory=dict)
    # masked greedy entries: the target's token at every row (lookahead's window reads them: trtpipe.serving.lookahead)
    targets: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, Any] = field(default_factory=dict)  # keep_logits entries: the [V] row sampled from


class StepEngine(Protocol):
    """What runs a step. ``allocate`` is called once with the pool size the executor chose."""

    def allocate(self, num_blocks: int, tokens_per_block: int) -> None: ...

    def step(self, batch: StepBatch) -> StepResult: ...

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots of block ``src`` into ``dst`` (partial prefix reuse)."""
        ...

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy KV slots ``src`` to ``dst`` in every layer (the accepted drafts of a masked verification)."""
        ...
