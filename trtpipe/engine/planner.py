"""The memory planner: will this recipe fit the target GPU, and how many sequences will the KV pool hold?

Per rank (docs/reference/trtllm-build.md#kv-cache-memory): device memory = engine weights + activations/workspace + a
runtime reserve + the KV pool. The pool is ``free_gpu_memory_fraction`` of what is left (or ``max_tokens``); its tokens
are split into ``tokens_per_block`` blocks and the block count is the minimum over ranks. KV bytes per token per rank =
2 x layers_on_rank x ceil(num_kv_heads / tp) x head_size x bytes(kv dtype): a KV head that is shared by several TP ranks
(num_kv_heads < tp) is stored on each of them.

Weights come from the checkpoint's ``rank{N}.safetensors`` when there is one, else from config.json shapes
and the quantization's bytes per element. Activations and the reserve are estimates (stated as such):
activations = max_num_tokens x (3 x hidden + local qkv width + local gated-MLP width) x activation bytes, plus
float32 logits for max_batch_size x max_beam_width sequences; the reserve (CUDA context, cuBLAS workspaces,
decoder buffers) is a fixed :data:`RUNTIME_RESERVE_BYTES`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from trtpipe.engine import ckptconfig
from trtpipe.engine.build_config import EngineBuild, builder_target
from trtpipe.engine.draft_plan import DraftMemory, draft_memory
from trtpipe.engine.enforce import rejections
from trtpipe.models.dims import MLA, checkpoint_dims
from trtpipe.errors import CheckpointError, EngineError
from trtpipe.formats.gpus import GPU
from trtpipe.formats.schemes import BY_QUANT_ALGO, BY_RECIPE, KV_SCHEMES, SCHEMES, quant_algos
from trtpipe.recipe.schema import Recipe

GiB = 1 << 30
PLAN_FILE = "trtpipe_plan.json"  # the engine stage's plan beside the engine (what the repo stage's KV pool reads)
RUNTIME_RESERVE_BYTES = 1 * GiB  # assumption: CUDA context + cuBLAS/cuBLASLt workspaces + decoder buffers
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# bytes per element of a quantized linear weight (group scales counted separately below): the scheme table's
QUANT_WEIGHT_BYTES = {None: None, **{s.quant_algo: s.weight_bytes for s in SCHEMES}}
# recipe algos a "does not fit" refusal may advise, in the table's advice order (least lossy first)
QUANT_KNOBS = tuple(sorted((s.recipe for s in BY_RECIPE.values() if s.advise), key=lambda a: BY_RECIPE[a].advise))
GROUPWISE = quant_algos(lambda s: s.groupwise)
KV_BYTES = {k.kv_cache_quant_algo: k.bytes for k in KV_SCHEMES}


@dataclass(frozen=True)
class Shapes:
    """The model dimensions the arithmetic needs, read from a checkpoint config.json (or its prediction)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    intermediate: int
    vocab: int
    experts: int
    top_k: int
    dtype: str
    quant_algo: Optional[str]
    kv_quant: Optional[str]
    group_size: int
    parallel_embedding: bool
    expert_quant_algo: Optional[str] = None  # experts stored apart from the recipe's algo (gpt-oss: W4A16_MXFP4)
    attn_bias: bool = False  # q/k/v/o biases
    expert_bias: bool = False  # gpt-oss: per-expert fc/proj biases, a router bias, one attention sink per head
    moe_ep: int = 1
    router_dtype: str = "float32"
    # attention data parallel (mapping.enable_attention_dp): every GPU holds the attention, dense MLPs, shared experts,
    # embedding and lm_head whole and all KV heads of its own requests; only the routed experts are split
    attention_dp: bool = False

    sliding_window: Optional[int] = None  # the attention window (on every layer, or on the sliding layers)
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention" where the model mixes them
    # DeepSeek-V3: latent attention (its cache: kv_lora_rank + qk_rope_head_dim values per token per layer, on every
    # tp rank), the leading dense layers (their MLP's width) and the shared experts' width
    mla: Optional[MLA] = None
    dense_layers: int = 0
    dense_intermediate: int = 0
    shared_width: int = 0

    @classmethod
    def of(cls, cfg: dict) -> "Shapes":
        """The model's dimensions (:func:`~trtpipe.models.dims.checkpoint_dims`) and the checkpoint's storage
        (dtype, quantization, mapping) of a checkpoint config.json."""
        d = checkpoint_dims(cfg)
        q = cfg.get("quantization") or {}
        return cls(
            hidden=d.hidden_size,
            layers=d.num_layers,
            heads=d.num_heads,
            kv_heads=d.num_kv_heads,
            head_size=d.head_dim,
            intermediate=d.expert_intermediate_size,  # an expert's width (Qwen3-MoE writes it apart)
            vocab=d.vocab_size,
            experts=d.num_experts,
            top_k=d.experts_per_token,
            dtype=str(cfg["dtype"]),
            quant_algo=q.get("quant_algo"),
            kv_quant=q.get("kv_cache_quant_algo"),
            group_size=int(q.get("group_size") or 128),
            parallel_embedding=bool(cfg.get("use_parallel_embedding", False)),
            expert_quant_algo=cfg.get("expert_quant_algo"),
            attn_bias=d.attention_bias,
            expert_bias=d.attention_sinks,
            moe_ep=int((cfg.get("mapping") or {}).get("moe_ep_size") or 1),
            attention_dp=bool((cfg.get("mapping") or {}).get("enable_attention_dp", False)),
            # the engine path keeps routers float32; a predicted llmapi config names the PyTorch backend's dtype
            router_dtype=str(cfg.get("router_dtype", "float32")),
            sliding_window=d.sliding_window,
            layer_types=d.layer_types,
            mla=d.mla,
            dense_layers=d.dense_layers if d.is_moe else 0,
            dense_intermediate=d.intermediate_size,
            shared_width=d.expert_intermediate_size * d.shared_experts,
        )

    def split(self, tp: int) -> int:
        """GPUs the attention heads, dense MLPs, embedding and lm_head are split over: tp, or 1 under attention DP."""
        return 1 if self.attention_dp else tp

    @property
    def model_bytes(self) -> int:
        if self.dtype not in DTYPE_BYTES:
            raise EngineError(f"config.json: dtype '{self.dtype}' is not float16, bfloat16 or float32")
        return DTYPE_BYTES[self.dtype]


def pp_layers(layers: int, pp: int) -> list[int]:
    """Layers per PP rank as torch.tensor_split gives them (the first ``layers % pp`` ranks get one more)."""
    return [layers // pp + (1 if r < layers % pp else 0) for r in range(pp)]


def kv_bytes_per_token(s: Shapes, layers_on_rank: int, tp: int) -> float:
    """2 (K and V) x layers x ceil(kv_heads / tp) x head_size x bytes(kv dtype), for one rank. MLA: layers x
    (kv_lora_rank + qk_rope_head_dim) x bytes, the latent and the rope key, on every tp rank (not split by heads).
    Attention DP: every KV head, for the GPU's own requests."""
    kv = KV_BYTES.get(s.kv_quant, s.model_bytes) if s.kv_quant else s.model_bytes
    if s.mla is not None:
        return layers_on_rank * s.mla.kv_values_per_token * kv
    return 2 * layers_on_rank * math.ceil(s.kv_heads / s.split(tp)) * s.head_size * kv


def weight_bytes(s: Shapes, tp: int, pp: int) -> list[int]:
    """Engine weight bytes of one TP rank on each PP rank, from shapes (lm_head and embeddings unquantized)."""
    if s.mla is not None:
        return _mla_weight_bytes(s, tp, pp)
    h, d = s.hidden, s.head_size
    q_local, kv_local = s.heads // s.split(tp), math.ceil(s.kv_heads / s.split(tp))
    attn = h * (q_local + 2 * kv_local) * d + q_local * d * h
    mlp = 3 * h * s.intermediate * max(1, s.experts) // tp  # E/moe_ep experts x I/moe_tp rows = E x I / tp
    linear_bytes = _linear_bytes(s, attn + mlp)
    if s.expert_quant_algo:  # experts kept in their own format, whatever the recipe quantizes
        linear_bytes = _linear_bytes(s, attn) + mlp * QUANT_WEIGHT_BYTES[s.expert_quant_algo]
    router = h * s.experts * DTYPE_BYTES[s.router_dtype] if s.experts > 1 else 0  # never quantized
    biases = ((q_local + 2 * kv_local) * d + h) * s.model_bytes if s.attn_bias else 0
    if s.expert_bias:  # E/moe_ep experts: fc bias 2I/moe_tp and proj bias H each; router bias (float32); sinks
        moe_tp = max(1, tp // s.moe_ep)
        biases += (s.experts // s.moe_ep) * (2 * s.intermediate // moe_tp + h) * s.model_bytes
        biases += s.experts * 4 + q_local * s.model_bytes
    per_layer = linear_bytes + router + biases + 2 * h * s.model_bytes
    vocab_local = math.ceil(s.vocab / s.split(tp))
    embed = (vocab_local if s.parallel_embedding else s.vocab) * h * s.model_bytes
    head = vocab_local * h * s.model_bytes + h * s.model_bytes  # lm_head + ln_f
    out = []
    for r, n in enumerate(pp_layers(s.layers, pp)):
        out.append(int(n * per_layer + (embed if r == 0 else 0) + (head if r == pp - 1 else 0)))
    return out


def _mla_weight_bytes(s: Shapes, tp: int, pp: int) -> list[int]:
    """DeepSeek-V3's weights per TP rank on each PP rank: q_a and kv_a (and their norms) replicated, q_b / kv_b /
    o_proj split by heads; dense MLPs in the first ``dense_layers``; routed experts (E x I / tp), the shared experts
    (split like a dense MLP), a router and its score bias (float32) in the others. Attention DP: all but the routed
    experts whole on every GPU (``ts`` = 1)."""
    h, a, b = s.hidden, s.mla, s.model_bytes
    ts = s.split(tp)
    qb = s.heads * a.qk_head_dim
    kvb = s.heads * (a.qk_nope_head_dim + a.v_head_dim)
    if a.q_lora_rank:
        q_rep, q_split = h * a.q_lora_rank, a.q_lora_rank * qb // ts
    else:
        q_rep, q_split = 0, h * qb // ts
    attn = _linear_bytes(s, q_rep + h * a.kv_values_per_token + q_split + a.kv_lora_rank * kvb // ts)
    attn += _linear_bytes(s, s.heads * a.v_head_dim * h // ts)
    attn += (a.q_lora_rank + a.kv_lora_rank + 2 * h) * b  # q_a / kv_a norms, the two layer norms
    dense = _linear_bytes(s, 3 * h * s.dense_intermediate // ts)
    routed = 3 * h * s.intermediate * s.experts // tp  # E / moe_ep experts x I / moe_tp rows
    routed_bytes = routed * QUANT_WEIGHT_BYTES[s.expert_quant_algo] if s.expert_quant_algo else _linear_bytes(s, routed)
    moe = routed_bytes + _linear_bytes(s, 3 * h * s.shared_width // ts) + s.experts * (h + 1) * 4
    vocab_local = math.ceil(s.vocab / ts)
    embed = (vocab_local if s.parallel_embedding else s.vocab) * h * b
    head = vocab_local * h * b + h * b
    out, first = [], 0
    for r, n in enumerate(pp_layers(s.layers, pp)):
        dense_n = max(0, min(first + n, s.dense_layers) - first)
        layers = n * attn + dense_n * dense + (n - dense_n) * moe
        out.append(int(layers + (embed if r == 0 else 0) + (head if r == pp - 1 else 0)))
        first += n
    return out


def linear_weight_bytes(quant_algo: Optional[str], elements: int, model_bytes: float, group_size: int) -> float:
    """Bytes of ``elements`` linear-weight elements stored as ``quant_algo`` (its row's bytes per weight, plus 16-bit
    scales per group for group-wise rows); unquantized or unknown: the model dtype."""
    s = BY_QUANT_ALGO.get(quant_algo) if quant_algo else None
    if s is None:
        return elements * model_bytes
    return elements * s.weight_bytes + (elements * 2 / group_size if s.groupwise else 0)


def _linear_bytes(s: Shapes, elements: int) -> float:
    return linear_weight_bytes(s.quant_algo, elements, s.model_bytes, s.group_size)


@dataclass(frozen=True)
class ExpertPlacement:
    """Where a mixture-of-experts model's routed experts live: each GPU holds ``experts / moe_ep`` whole experts,
    each cut to ``intermediate / moe_tp`` rows (TensorRT-LLM's Mapping: moe_ep x moe_tp = tp)."""

    experts: int
    moe_ep: int
    moe_tp: int
    width: int  # an expert's intermediate rows on one GPU
    layer_bytes: int  # this GPU's expert weights (gate, up, down) of one layer
    gpu_bytes: int  # the same over the layers of the largest pp rank

    @property
    def per_rank(self) -> int:
        return self.experts // self.moe_ep


def expert_placement(s: Shapes, cfg: dict, pp: int) -> Optional[ExpertPlacement]:
    """The experts one GPU holds and their bytes (None for a dense model)."""
    if s.experts <= 1:
        return None
    m = cfg.get("mapping") or {}
    ep, mtp = int(m.get("moe_ep_size", 1)), int(m.get("moe_tp_size", m.get("tp_size", 1)))
    width = s.intermediate // mtp
    elements = (s.experts // ep) * 3 * s.hidden * width
    # experts kept in their own format (gpt-oss's MXFP4) are sized in it, as weight_bytes sizes them
    layer = int(
        elements * QUANT_WEIGHT_BYTES[s.expert_quant_algo] if s.expert_quant_algo else _linear_bytes(s, elements)
    )
    moe_layers, first = [], 0  # per pp rank, its MoE layers (DeepSeek-V3's first dense_layers hold no experts)
    for n in pp_layers(s.layers, pp):
        moe_layers.append(n - max(0, min(first + n, s.dense_layers) - first))
        first += n
    return ExpertPlacement(s.experts, ep, mtp, width, layer, layer * max(moe_layers))


def checkpoint_weight_bytes(ckpt_dir: Path, tp: int, pp: int) -> list[int]:
    """Tensor bytes of each PP rank's largest TP shard, read from the safetensors headers."""
    out = []
    for p in range(pp):
        sizes = []
        for t in range(tp):
            f = ckpt_dir / f"rank{p * tp + t}.safetensors"
            if not f.is_file():
                raise EngineError(f"{f}: missing (checkpoint has tp={tp}, pp={pp})")
            sizes.append(_tensor_bytes(f))
        out.append(max(sizes))
    return out


def _tensor_bytes(f: Path) -> int:
    """Sum of the tensors' bytes in one safetensors file, from its header (the checkpoint reader's own checks)."""
    from trtpipe.checkpoint.hf import SafetensorsFile  # lazy: torch is only needed when a checkpoint is given

    try:
        st = SafetensorsFile(f)
    except CheckpointError as exc:
        raise EngineError(str(exc)) from None
    try:
        return sum(numel * dtype.itemsize for dtype, _, _, numel in st.entries.values())
    finally:
        st.close()


def activation_bytes(s: Shapes, tp: int, max_num_tokens: int, max_batch: int, beam: int) -> int:
    act = 4 if s.dtype == "float32" else 2
    qkv = (s.heads // s.split(tp) + 2 * math.ceil(s.kv_heads / s.split(tp))) * s.head_size
    mlp = 2 * s.intermediate // tp * (max(1, s.top_k) if s.experts > 1 else 1)
    logits = max_batch * beam * s.vocab * 4
    return int(max_num_tokens * (3 * s.hidden + qkv + mlp) * act + logits)


@dataclass(frozen=True)
class RankPlan:
    pp_rank: int
    layers: int
    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    free_bytes: int  # after weights, activations and the reserve
    kv_bytes_per_token: float
    kv_pool_bytes: int
    kv_tokens: int
    kv_blocks: int


@dataclass(frozen=True)
class Plan:
    gpu: GPU
    tp: int
    pp: int
    weights_from: str  # "checkpoint" or "config.json"
    kv_dtype: str
    ranks: tuple[RankPlan, ...]
    tokens_per_block: int
    max_seq_len: int
    max_input_len: int
    max_batch_size: int
    max_beam_width: int
    blocks_per_sequence: int
    kv_blocks: int  # MIN over ranks
    kv_tokens: int
    concurrent_sequences: int  # full-length sequences the pool holds
    host_bytes: dict[str, int] = field(default_factory=dict)
    experts: Optional[ExpertPlacement] = None
    refusal: str = ""
    kv_bytes_per_token_model: int = 0  # whole model, one copy of each KV head
    runtime: bool = True  # the KV pool and host memory planned too (False: the engine alone, see plan_build)
    draft: Optional[DraftMemory] = None  # speculative decoding's share (trtpipe/engine/draft_plan.py)
    attention_dp: bool = False  # each GPU's KV pool holds its own requests (concurrent_sequences: all GPUs')

    @property
    def fits(self) -> bool:
        return not self.refusal

    def summary(self) -> dict[str, Any]:
        r0 = max(self.ranks, key=lambda r: r.weight_bytes)
        return {
            "gpu": self.gpu.key,
            "tp": self.tp,
            "pp": self.pp,
            "attention_dp": self.attention_dp,
            "fits": self.fits,
            "refusal": self.refusal or None,
            "weights_from": self.weights_from,
            "weight_bytes_per_gpu": r0.weight_bytes,
            "activation_bytes": r0.activation_bytes,
            "reserve_bytes": r0.reserve_bytes,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token_model": self.kv_bytes_per_token_model,
            "kv_bytes_per_token_per_gpu": [r.kv_bytes_per_token for r in self.ranks],
            "free_bytes_per_gpu": [r.free_bytes for r in self.ranks],
            "kv_pool_bytes": [r.kv_pool_bytes for r in self.ranks] if self.runtime else None,
            "kv_tokens": self.kv_tokens if self.runtime else None,
            "kv_blocks": self.kv_blocks if self.runtime else None,
            "tokens_per_block": self.tokens_per_block,
            "max_seq_len": self.max_seq_len,
            "blocks_per_sequence": self.blocks_per_sequence,
            "concurrent_sequences": self.concurrent_sequences if self.runtime else None,
            "max_batch_size": self.max_batch_size,
            "host_bytes": self.host_bytes if self.runtime else None,
            "draft": None if self.draft is None else asdict(self.draft),
            "experts": None
            if self.experts is None
            else {
                "experts": self.experts.experts,
                "moe_ep": self.experts.moe_ep,
                "moe_tp": self.experts.moe_tp,
                "experts_per_gpu": self.experts.per_rank,
                "expert_width_per_gpu": self.experts.width,
                "expert_bytes_per_layer_per_gpu": self.experts.layer_bytes,
                "expert_bytes_per_gpu": self.experts.gpu_bytes,
            },
        }


def blocks_per_sequence(seq: int, inp: int, tpb: int, beam: int) -> int:
    """Blocks one sequence needs (kvCacheManager.cpp): beam 1 = ceil(seq/tpb); beams share the full context blocks."""
    if beam == 1:
        return math.ceil(seq / tpb)
    shared = inp // tpb
    return shared + (math.ceil(seq / tpb) - shared) * beam


def sequence_blocks(s: Shapes, c, tpb: int) -> int:
    """Blocks one sequence of max_seq_len needs (kvCacheManager.cpp): the KV cache holds min(seq_len,
    attention_window) tokens; the window is the model's sliding_window (what the repository passes as
    max_attention_window_size).

    A model whose layers differ (Gemma 3, ``layer_types``) has the window on its sliding layers only: the pool here
    is counted in tokens of every layer, so one sequence needs the layer average of min(seq_len, window of the
    layer) such tokens (global layers hold all max_seq_len tokens; counting the window for every layer would
    promise sequences the global layers cannot hold, and counting max_seq_len for every layer undercounts them).
    The C++ runtime keeps one pool per window size and splits memory in proportion to window x layers
    (NVIDIA/TensorRT-LLM ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``
    ``BlockManager::calculateWindowSizeToShare``), which holds the same number of full sequences in every pool:
    this layer average, up to each pool's block rounding."""
    window, types = s.sliding_window, s.layer_types
    if types and window:
        held = sum(min(c.max_seq_len, int(window)) if t == "sliding_attention" else c.max_seq_len for t in types)
        seq = math.ceil(held / len(types))
        return blocks_per_sequence(seq, min(c.max_input_len, seq), tpb, c.max_beam_width)
    seq = min(c.max_seq_len, int(window)) if window else c.max_seq_len
    return blocks_per_sequence(seq, min(c.max_input_len, seq), tpb, c.max_beam_width)


def _kv_dtype(s: Shapes) -> str:
    return s.kv_quant.lower() if s.kv_quant else s.dtype


def _layer_work(s: Shapes, batch: int, seq: int) -> int:
    """float32 bytes one batch of ``seq`` tokens allocates going through one unsharded decoder layer: norms and
    residuals (4 x hidden), the fused qkv output, the gated MLP (3 x intermediate per active expert) and the
    attention scores and probabilities (2 x heads x seq x seq)."""
    width = 4 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_size + 3 * s.intermediate * max(1, s.top_k)
    return 4 * (batch * seq * width + 2 * batch * s.heads * seq * seq)


def host_estimates(
    s_full: Shapes, source_dtype_bytes: int, rank_bytes: int, workers: int, recipe: Recipe
) -> dict[str, int]:
    """Host RAM each build stage needs (estimates of what the code holds at its peak; see each line).

    calibrate / quantize / verify run one decoder layer at a time (trtpipe/quant): about one float32 layer, its
    largest weight in working copies, one batch's activations, and the hidden-state buffers of every sample
    (``num_samples x seq_len x hidden`` float32 each; they spill to memory-mapped files past 1 GiB, so this is an
    upper bound). ``self`` data is sampled from the whole float32 model first (then freed), so the stage needs
    the larger of the two. ``verify_greedy`` is the greedy-continuation metric: one whole float32 model at a
    time, run only when that fits in the available host memory (else the report says it was skipped). The
    synthetic-model test (tests/quant/test_host_memory.py) measures peaks 6-33% above these numbers (allocator
    slack; it allows 40%), flat in the number of layers.
    """
    mb = s_full.model_bytes
    full_unquant = sum(weight_bytes(replace(s_full, quant_algo=None), 1, 1))
    params = full_unquant // mb
    h, v = s_full.hidden, s_full.vocab
    layer = (full_unquant - 2 * v * h * mb) // max(1, s_full.layers)  # unquantized bytes of one layer
    unit = max(layer, v * h * mb) // mb
    layer_params = layer // mb
    experts = max(1, s_full.experts)
    largest = max(h * (s_full.heads + 2 * s_full.kv_heads) * s_full.head_size, experts * s_full.intermediate * h)
    qb = QUANT_WEIGHT_BYTES.get(s_full.quant_algo) or mb  # bytes per element of a quantized layer's weights
    whole_f32 = params * (4 + mb)  # load_checkpoint: float32 copies while the stored tensors are read
    embed = v * h * (4 + mb)  # the embedding read, then in float32
    c, acc = recipe.quantization.calibration, recipe.accuracy
    calib = 2 * c.num_samples * c.seq_len * h * 4 + max(
        embed, layer_params * 4 + largest * mb + _layer_work(s_full, c.batch_size, c.seq_len)
    )
    streams = 3 if s_full.kv_quant else 2  # unquantized, quantized (and quantized with the KV cache unquantized)
    verify = streams * acc.num_samples * acc.seq_len * h * 4 + max(
        embed,
        layer_params * (4 + qb) + largest * 4 + _layer_work(s_full, c.batch_size, acc.seq_len),  # f32 + stored
        2 * v * h * 4 + v * h * mb + 6 * c.batch_size * acc.seq_len * v * 4,
    )  # both lm_heads + a batch's logits
    return {
        # the converter streams one unit (a layer, or the embedding) at a time: source + fused + rank shards
        "checkpoint": unit * (source_dtype_bytes + 2 * mb),
        # one float32 layer (read on the host, also when calibrating on a GPU) + the sample buffers (in and out)
        "calibrate": max(calib, whole_f32 if c.dataset == "self" else 0),
        # one unsharded float32 layer, its quantized tensors, working copies of its largest weight
        "quantize": max(layer_params * (4 + qb) + 2 * largest * 4, v * h * mb),
        "verify": max(verify, whole_f32 if acc.eval_data == "self" else 0),
        "verify_greedy": whole_f32,
        "engine": 2 * rank_bytes * max(1, workers),  # per worker: rank weights + TensorRT's network copy
    }


def plan_build(
    recipe: Recipe,
    cfg: dict,
    build: EngineBuild,
    checkpoint_dir: Optional[Path] = None,
    source_dtype_bytes: int = 2,
    runtime: bool = True,
) -> Plan:
    """Plan one rank layout. Never raises for a recipe that does not fit: ``Plan.refusal`` says why and what to turn.

    ``runtime=False`` plans what the engine alone fixes (weights, activations, the reserve, KV bytes per token,
    blocks per sequence) and reads nothing else of the recipe: the engine stage's plan, which its key covers. The
    KV pool (``engine.kv_cache``, a runtime setting) is then :func:`kv_pool`'s, in the repo stage, and the host
    memory of the other stages is not estimated."""
    s = Shapes.of(cfg)
    tp, pp = ckptconfig.mapping(cfg)
    c = build.config
    gpu = build.gpu
    tpb = c.plugins["tokens_per_block"]
    kvc = recipe.engine.kv_cache if runtime else None
    # the recipe's checkpoint is converted tp-split whatever the serving layout: attention DP is planned from shapes
    if checkpoint_dir is not None and not s.attention_dp and any(Path(checkpoint_dir).glob("rank*.safetensors")):
        weights, source = checkpoint_weight_bytes(Path(checkpoint_dir), tp, pp), "checkpoint"
    else:
        weights, source = weight_bytes(s, tp, pp), "config.json"
    act = activation_bytes(s, tp, c.max_num_tokens, c.max_batch_size, c.max_beam_width)
    draft = draft_memory(
        recipe, tp, kv_bytes_per_token(s, 1, 1) / (2 * s.kv_heads * s.head_size), kv_bytes_per_token(s, 1, tp)
    )
    weights = [w + (draft.weight_bytes if draft else 0) for w in weights]
    ranks = []
    for r, n in enumerate(pp_layers(s.layers, pp)):
        free = gpu.memory_bytes - weights[r] - act - RUNTIME_RESERVE_BYTES
        per_tok = kv_bytes_per_token(s, n, tp) + (draft.kv_bytes_per_token if draft else 0)
        pool = int(max(free, 0) * kvc.free_gpu_memory_fraction) if kvc is not None else 0
        tokens = int(pool // per_tok) if per_tok else 0
        if kvc is not None and kvc.max_tokens is not None:
            tokens = min(tokens, kvc.max_tokens)
        ranks.append(
            RankPlan(r, n, weights[r], act, RUNTIME_RESERVE_BYTES, free, per_tok, pool, tokens, math.ceil(tokens / tpb))
        )
    blocks = min(r.kv_blocks for r in ranks)
    per_seq = sequence_blocks(s, replace(c, max_seq_len=c.max_seq_len + draft.extra_positions) if draft else c, tpb)
    plan = Plan(
        gpu=gpu,
        tp=tp,
        pp=pp,
        weights_from=source,
        kv_dtype=_kv_dtype(s),
        ranks=tuple(ranks),
        tokens_per_block=tpb,
        max_seq_len=c.max_seq_len,
        max_input_len=c.max_input_len,
        max_batch_size=c.max_batch_size,
        max_beam_width=c.max_beam_width,
        blocks_per_sequence=per_seq,
        kv_blocks=blocks,
        kv_tokens=min(r.kv_tokens for r in ranks),
        concurrent_sequences=blocks // per_seq * (tp if s.attention_dp else 1),  # attention DP: a pool per GPU
        attention_dp=s.attention_dp,
        kv_bytes_per_token_model=int(kv_bytes_per_token(s, s.layers, 1)),
        experts=expert_placement(s, cfg, pp),
        host_bytes=host_estimates(s, source_dtype_bytes, max(weights), build.workers, recipe) if runtime else {},
        runtime=runtime,
        draft=draft,
    )
    return replace(plan, refusal=_refusal(plan, recipe, cfg, build))


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _refusal(plan: Plan, recipe: Recipe, cfg: dict, build: EngineBuild) -> str:
    worst = min(plan.ranks, key=lambda r: r.free_bytes)
    name = f"{plan.tp * plan.pp}x {plan.gpu.key}"
    if worst.free_bytes <= 0:
        need = worst.weight_bytes + worst.activation_bytes + worst.reserve_bytes
        return (
            f"does not fit: per-GPU weights {_gib(worst.weight_bytes)} + activations {_gib(worst.activation_bytes)} "
            f"+ runtime reserve {_gib(worst.reserve_bytes)} = {_gib(need)} exceed one {plan.gpu.key} "
            f"({_gib(plan.gpu.memory_bytes)}) at tp={plan.tp} pp={plan.pp}; turn a knob: {_knobs(recipe, cfg, build, kv_only=False)}"
        )
    if plan.runtime and plan.kv_blocks < plan.blocks_per_sequence:
        return (
            f"does not fit: the KV pool ({plan.kv_tokens} tokens, {plan.kv_blocks} blocks of {plan.tokens_per_block}) "
            f"cannot hold one sequence of max_seq_len {plan.max_seq_len} ({plan.blocks_per_sequence} blocks) on {name}; "
            f"turn a knob: {_knobs(recipe, cfg, build, kv_only=True, tokens=plan.kv_tokens)}"
        )
    return ""


def kv_pool(engine_plan: dict, kv_cache) -> tuple[dict, str]:
    """The KV pool of a planned engine (its ``plan_build(runtime=False)`` summary) under the ``engine.kv_cache``
    settings, as :func:`plan_build` computes it with ``runtime``: ``({kv_pool_bytes, kv_tokens, kv_blocks,
    concurrent_sequences}, refusal)``, the refusal empty when one sequence of max_seq_len fits."""
    tpb = engine_plan["tokens_per_block"]
    pools, tokens = [], []
    for free, per_tok in zip(engine_plan["free_bytes_per_gpu"], engine_plan["kv_bytes_per_token_per_gpu"]):
        pool = int(max(free, 0) * kv_cache.free_gpu_memory_fraction)
        n = int(pool // per_tok) if per_tok else 0
        pools.append(pool)
        tokens.append(n if kv_cache.max_tokens is None else min(n, kv_cache.max_tokens))
    blocks = min(math.ceil(t / tpb) for t in tokens)
    per_seq = engine_plan["blocks_per_sequence"]
    out = {
        "kv_pool_bytes": pools,
        "kv_tokens": min(tokens),
        "kv_blocks": blocks,
        "concurrent_sequences": blocks // per_seq,
    }
    refusal = ""
    if blocks < per_seq:
        name = f"{engine_plan['tp'] * engine_plan['pp']}x {engine_plan['gpu']}"
        shorter = min(tokens) // tpb * tpb
        refusal = (
            f"does not fit: the KV pool ({min(tokens)} tokens, {blocks} blocks of {tpb}) cannot hold one sequence of "
            f"max_seq_len {engine_plan['max_seq_len']} ({per_seq} blocks) on {name}; turn a knob: "
            + (f"engine.max_seq_len <= {shorter}, or " if shorter else "")
            + "a larger engine.kv_cache.free_gpu_memory_fraction or a smaller engine.max_num_tokens"
        )
    return out, refusal


def _quick_fits(recipe: Recipe, cfg: dict, build: EngineBuild) -> bool:
    """Whether weights, activations and one full sequence of KV fit every rank (for the knob suggestions)."""
    s = Shapes.of(cfg)
    tp, pp = ckptconfig.mapping(cfg)
    c = build.config
    tpb = c.plugins["tokens_per_block"]
    act = activation_bytes(s, tp, c.max_num_tokens, c.max_batch_size, c.max_beam_width)
    need = sequence_blocks(s, c, tpb) * tpb
    for r, (w, n) in enumerate(zip(weight_bytes(s, tp, pp), pp_layers(s.layers, pp))):
        free = build.gpu.memory_bytes - w - act - RUNTIME_RESERVE_BYTES
        if free <= 0 or free * recipe.engine.kv_cache.free_gpu_memory_fraction < need * kv_bytes_per_token(s, n, tp):
            return False
    return True


def _knobs(recipe: Recipe, cfg: dict, build: EngineBuild, kv_only: bool, tokens: int = 0) -> str:
    s = Shapes.of(cfg)
    tp, pp = ckptconfig.mapping(cfg)
    out = []
    for t in (2, 4, 8, 16, 32, 64):
        if t > tp and s.heads % t == 0 and _quick_fits(recipe, _with(cfg, tp=t), build):
            out.append(f"parallel.tp: {t}")
            break
    qa, kv = ckptconfig.quant(cfg)
    if kv is None and _quick_fits(recipe, _with(cfg, kv_cache_quant_algo="FP8"), build) and build.gpu.sm >= 89:
        out.append("quantization.kv_cache: fp8")
    if not kv_only:
        current = QUANT_WEIGHT_BYTES.get(qa) or s.model_bytes
        for name, algo in _algo_knobs(recipe, s, cfg, build.gpu):
            if QUANT_WEIGHT_BYTES[algo] < current and _quick_fits(recipe, _with(cfg, quant_algo=algo), build):
                out.append(f"quantization.algo: {name}")
                break
    if kv_only and tokens >= build.config.plugins["tokens_per_block"]:
        tpb = build.config.plugins["tokens_per_block"]
        out.append(f"engine.max_seq_len <= {tokens // tpb * tpb}")
    if kv_only:
        out.append("a larger engine.kv_cache.free_gpu_memory_fraction or a smaller engine.max_num_tokens")
    if not out:
        out.append("a GPU with more memory (engine.gpu) or more pipeline stages (parallel.pp)")
    return ", or ".join(out)


def _algo_knobs(recipe: Recipe, s: Shapes, cfg: dict, gpu: GPU) -> list[tuple[str, str]]:
    """The quantization algos the advice may name, as (recipe algo, checkpoint quant_algo), in :data:`QUANT_KNOBS`
    order: only those the recipe's target writes (the TRT-LLM checkpoint layouts, or the unified HF export and, for
    a mixture-of-experts model, its expert layouts) and that run on ``gpu`` (trtllm-build's rejections: FP8 below
    SM 8.9, FP4 below SM 10.0, weight-only on Blackwell). Advice the validation would then refuse, such as int4_awq
    for MoE experts on llmapi, costs the user a round trip."""
    moe = recipe.target == "llmapi" and s.experts  # the engine's expert refusals are validate's (quant rules)
    writers = {n: r.quant_algo for n, r in BY_RECIPE.items() if recipe.target in (r.moe if moe else r.targets)}
    out = []
    for name in QUANT_KNOBS:
        algo = writers.get(name)
        if algo and not any(
            key == "quantization.algo" for key, _ in rejections({}, builder_target(_with(cfg, quant_algo=algo), gpu))
        ):
            out.append((name, algo))
    return out


def _with(cfg: dict, **changes) -> dict:
    cfg2 = json.loads(json.dumps(cfg))
    m = cfg2.setdefault("mapping", {})
    if "tp" in changes:
        m["tp_size"] = changes["tp"]
        m["world_size"] = changes["tp"] * int(m.get("pp_size", 1))
    q = cfg2.setdefault("quantization", {})
    for k in ("quant_algo", "kv_cache_quant_algo"):
        if k in changes:
            q[k] = changes[k]
    return cfg2
