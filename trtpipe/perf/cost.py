"""The step-cost model: how long one engine step takes, from roofline terms per layer.

A step runs every decoder layer once over the batch's tokens (context chunks and one token per generating
request). Per GPU and per step, the model counts

- bytes read from HBM: the rank's weights once per step (MoE: only the experts some token was routed to), plus
  the KV cache every generating request attends over (sliding-window layers read at most their window);
- GEMM FLOPs at the precision's dense tensor peak (2 x tokens x parameters, routed experts by top-k);
- attention FLOPs (causal context pairs, and decode pairs) at the 16-bit tensor peak;
- the tensor-parallel all-reduces (two per layer, ring: 2 (tp-1)/tp x bytes) or, with attention data
  parallelism, each MoE layer's all-gather of every rank's tokens and reduce-scatter of its output, over the GPU
  link. That is what the PyTorch backend's CUTLASS MoE does without an MNNVL all-to-all
  (NVIDIA/TensorRT-LLM@000a01de ``tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py``: ``allgather`` of
  the inputs, ``fused_moe`` over all ranks' tokens, ``reducescatter``): each token crosses the link once each way
  whatever its top-k, not once per routed copy.

These raw terms are seconds at 100% of the catalog's peaks (:class:`Terms`); :class:`Constants` turns them into a
time with a small number of named constants fitted on NVIDIA's published numbers (scripts/fit_perf.py)::

    memory  = weights / bw_eff + kv / kv_eff            compute = gemm / gemm_eff + attn / attn_eff
    t = (max(memory, compute) + serial x min(memory, compute) + comm / link_eff
         + layers x (layer_us + sequences x seq_layer_us)) x (1 + pp_bubble x (pp - 1))

(the PyTorch backend's set adds GEMM rates that follow the GPU's peak, the routed experts' own GEMM rate and a
cost per routed token copy: :func:`step_time`, :func:`_gemm_time`).

``serial`` is how much of the smaller of memory and compute time is not hidden under the larger (0: a perfect
roofline; the published engine numbers fit 1, i.e. the kernels of a step do not overlap the two). ``layer_us``
is the fixed cost of a layer per step (norms, rope, launches, all-reduce latency); ``seq_layer_us`` the cost of
each sequence in each layer (per-request attention work). With pipeline parallelism the terms are those of the
busiest stage, and the executor's batch is assumed spread over pp micro-batches that keep every stage busy
(``pp_bubble`` is the loss). ``other_gb`` (memory the KV pool cannot use) is not a time constant but is fitted
with the others, since the KV pool decides the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, Sequence

from trtpipe.formats.gpus import GPU
from trtpipe.errors import TrtpipeError
from trtpipe.formats.schemes import BY_QUANT_ALGO, KV_SCHEMES, SCHEMES
from trtpipe.perf.models import ModelSpec

GB = 1e9
TERA = 1e12
# MLA generation attention on Hopper: TensorRT-LLM runs FlashMLA for a 576-wide latent on SM 9.0
# (NVIDIA/TensorRT-LLM@1a0dc5f7 tensorrt_llm/_torch/model_config.py ``enable_flash_mla``), whose dense decoding kernel
# reaches 660 TFLOPS compute-bound on H800 SXM5 (deepseek-ai/FlashMLA@066b5ba6 README.md), the H100 SXM die at 989
# dense 16-bit TFLOPS: that measured fraction, not the fitted ``attn_eff`` of the other attention kernels
FLASH_MLA_DECODE_EFF = 660 / 989
ACT_BYTES = 2  # activations (all-reduce payloads) are 16-bit


@dataclass(frozen=True)
class Precision:
    """Bytes per weight of the quantized linears and the tensor peak their GEMMs run at."""

    weight_bytes: float
    peak: str  # GPU attribute: tflops_16, tflops_fp8, tflops_fp4, tops_int8


PER_GROUP_BYTES = 2 / 128  # group-wise scales: 16-bit, one per 128 inputs (the group size the model assumes)
# the 16-bit precisions, then each scheme's (the scheme table's perf, weight_bytes and peak columns)
PRECISIONS: dict[str, Precision] = {
    "fp16": Precision(2, "tflops_16"),
    "bf16": Precision(2, "tflops_16"),
    **{s.perf: Precision(s.weight_bytes + (PER_GROUP_BYTES if s.groupwise else 0), s.peak) for s in SCHEMES if s.perf},
}
KV_BYTES = {"fp16": 2, "bf16": 2, **{k.perf: k.bytes for k in KV_SCHEMES if k.perf}}
MXFP4_BYTES = BY_QUANT_ALGO["W4A16_MXFP4"].weight_bytes  # GPT-OSS experts: 4-bit values + one 8-bit scale per 32


@dataclass(frozen=True)
class Deployment:
    """One model on ``tp x pp`` GPUs of one type: what the step cost depends on besides the batch."""

    model: ModelSpec
    gpu: GPU
    precision: str = "fp16"
    kv: str = "fp16"
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel size inside the tp group (1: every rank holds 1/tp of every expert)
    attn_dp: bool = False  # attention data parallel over the tp GPUs (each holds all attention weights)
    pytorch_backend: bool = False  # sizes its KV pool after a max_num_tokens forward pass (profiling_activation_bytes)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise TrtpipeError(f"precision '{self.precision}' has no performance model ({', '.join(PRECISIONS)})")
        if self.kv not in KV_BYTES:
            raise TrtpipeError(f"kv cache dtype '{self.kv}' has no performance model ({', '.join(KV_BYTES)})")
        peak = getattr(self.gpu, PRECISIONS[self.precision].peak)
        if not peak or not self.gpu.tflops_16:
            raise TrtpipeError(
                f"GPU '{self.gpu.key}' has no {PRECISIONS[self.precision].peak} in the catalog "
                f"(trtpipe/formats/gpus.py); {self.precision} cannot be modelled on it"
            )
        if self.tp * self.pp > 1 and not self.gpu.link_gbs:
            raise TrtpipeError(f"GPU '{self.gpu.key}' has no link bandwidth in the catalog; tp/pp cannot be modelled")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def stage_layers(self) -> float:
        """Fraction of the model's layers on the busiest pipeline stage."""
        n = self.model.num_layers
        return math.ceil(n / self.pp) / n

    @property
    def gemm_peak(self) -> float:
        return getattr(self.gpu, PRECISIONS[self.precision].peak) * TERA

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token stores on one GPU of the busiest stage (KV heads replicated when tp > heads)."""
        m = self.model
        heads_local = m.kv_heads if self.attn_dp else math.ceil(m.kv_heads / self.tp)
        per_layer = m.kv_elems * heads_local / m.kv_heads
        return per_layer * m.num_layers * self.stage_layers * KV_BYTES[self.kv]

    def profiling_activation_bytes(self, max_num_tokens: int) -> float:
        """Activation memory of the forward pass the PyTorch backend runs before it sizes the KV pool: a dummy
        context batch of ``max_num_tokens`` tokens per rank, after which the pool gets ``fraction x (total - peak)``
        (NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/_util.py``, ``KvCacheCreator``: ``peak_memory`` is the
        torch peak of that pass plus non-torch allocations). Estimated as the largest layer's transient buffers in
        16 bits: per token three hidden vectors and the outputs of the rank's dense linears (about their parameters
        / hidden); an MoE layer adds the fused MoE's rows -- every token of every attention-DP rank (the MoE
        all-gathers them: ``moe_max_num_tokens = max_num_tokens x world size``, ``fused_moe_cutlass.py``) times
        top-k, each holding its input and output (hidden) and the gated FC1 output and activation (3 x the
        expert's intermediate width on this rank). No fitted multiplier: the estimate is taken at face value."""
        if not max_num_tokens:
            return 0.0
        m = self.model
        dp = self.tp if self.attn_dp else 1
        split = 1 if self.attn_dp else self.tp
        peak = 0.0
        for k in m.layers:
            per_token = 3 * m.hidden + (k.attn_params + k.mlp_params) / split / m.hidden
            act = max_num_tokens * per_token
            if k.experts:
                inter = k.expert_params / (3 * m.hidden) / max(1, self.tp // self.ep)
                act += max_num_tokens * dp * k.top_k * (2 * m.hidden + 3 * inter)
            peak = max(peak, act * ACT_BYTES)
        return peak

    @property
    def vocab_split(self) -> int:
        """GPUs the embedding and lm_head are split over: none under attention DP, where every rank samples its own
        requests against a whole lm_head (NVIDIA/TensorRT-LLM@cb4c622c ``tensorrt_llm/_torch/models/modeling_utils.py``
        ``DecoderModelForCausalLM``: ``LMHead`` without a mapping when ``enable_attention_dp``; the embedding likewise,
        e.g. ``Llama4Model`` @3a5901cd ``modeling_llama.py``), else tp."""
        return 1 if self.attn_dp else self.tp

    @property
    def dense_peak(self) -> float:
        """Tensor peak of the non-expert GEMMs: an MXFP4 checkpoint (GPT-OSS) keeps them in BF16."""
        return self.gpu.tflops_16 * TERA if self.model.mxfp4_experts else self.gemm_peak

    @property
    def expert_peak(self) -> float:
        """Tensor peak of the routed-expert GEMMs. MXFP4 experts run as MXFP4 x MXFP8 on Blackwell (SM 10.x) and
        as 4-bit weights x BF16 activations elsewhere (the Triton MoE backend on Hopper, converted to BF16 inside
        the GEMM: NVIDIA/TensorRT-LLM@d513eeaf examples/models/core/gpt_oss/README.md, MoE support matrix)."""
        if not self.model.mxfp4_experts:
            return self.gemm_peak
        if self.gpu.sm >= 100 and self.gpu.tflops_fp8:
            return self.gpu.tflops_fp8 * TERA
        return self.gpu.tflops_16 * TERA

    def _weight_bytes(self, params: float, expert: bool = False) -> float:
        if self.model.mxfp4_experts:  # MXFP4 experts, every other linear in BF16 (the checkpoint's own dtypes)
            return params * (MXFP4_BYTES if expert else 2)
        return params * PRECISIONS[self.precision].weight_bytes

    @property
    def weight_bytes_per_gpu(self) -> float:
        """All weights one GPU of the busiest stage holds (embedding and lm_head in 16-bit, split over tp)."""
        dense_split = 1 if self.attn_dp else self.tp
        total = 0.0
        for k in self.model.layers:
            dense = (k.attn_params + k.mlp_params) / dense_split
            experts = k.experts * k.expert_params / self.tp
            total += k.count * (self._weight_bytes(dense) + self._weight_bytes(experts, True))
        total *= self.stage_layers
        return total + 2 * self.model.vocab * self.model.hidden * 2 / self.vocab_split


@dataclass(frozen=True)
class Terms:
    """Seconds at 100% of the catalog's peaks, for one GPU of the busiest stage (numpy arrays work too); ``seqs``,
    ``layers``, ``pp`` and ``copies`` are counts."""

    mem: float  # weight bytes / peak HBM bandwidth
    kv: float  # KV-cache bytes the attention kernels read / peak HBM bandwidth
    gemm: float  # GEMM FLOPs / the precision's dense tensor peak
    attn: float  # attention FLOPs / the 16-bit tensor peak
    comm: float  # collective bytes / link bandwidth
    seqs: float  # sequences in the step (per-sequence host and sampling work)
    layers: float  # decoder layers on the stage (fixed per-layer costs)
    pp: int = 1
    peak_pf: float = 0.0  # the precision's dense tensor peak in PFLOPS (what the achieved fraction of it depends on)
    expert_gemm: float = 0.0  # the routed experts' share of ``gemm`` (their grouped GEMMs)
    copies: float = 0.0  # routed token copies (tokens x top-k on this GPU) summed over the stage's MoE layers
    mla_decode: float = 0.0  # MLA generation attention FLOPs / the 16-bit peak where FlashMLA runs it (SM 9.0)

    # facts of the deployment, not amounts of work: a sum of two steps' terms keeps them
    FIXED = ("layers", "pp", "peak_pf")

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(
            **{
                f.name: getattr(self, f.name) + (0 if f.name in self.FIXED else getattr(other, f.name))
                for f in fields(self)
            }
        )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class Constants:
    """The fitted efficiencies. Defaults are AIConfigurator-like priors, used only before a fit exists."""

    bw_eff: float = 0.8  # achieved fraction of peak HBM bandwidth reading weights
    kv_eff: float = 0.6  # achieved fraction of peak HBM bandwidth reading the KV cache (decode attention)
    gemm_eff: float = 0.6  # achieved fraction of the dense tensor peak on GEMMs
    attn_eff: float = 0.4  # achieved fraction of the 16-bit peak on attention kernels
    link_eff: float = 0.7  # achieved fraction of the link bandwidth on all-reduce / all-to-all
    seq_layer_us: float = 0.5  # microseconds per sequence per layer (per-request attention work and launches)
    serial: float = 0.3  # fraction of the smaller of memory and compute time not hidden under the larger
    layer_us: float = 15.0  # fixed microseconds per decoder layer per step
    pp_bubble: float = 0.1  # throughput lost per extra pipeline stage
    other_gb: float = 3.5  # GB per GPU the KV pool cannot use besides weights (context, workspaces, activations)
    flop_drop: float = 0.0  # GEMM time grows by this fraction per PFLOPS of the precision's dense tensor peak
    expert_eff: float = 0.0  # achieved fraction of the tensor peak on routed-expert GEMMs (0: the dense GEMMs' rate)
    expert_drop: float = 0.0  # routed-expert GEMM time grows by this fraction per PFLOPS (as flop_drop)
    copy_ns: float = 0.0  # nanoseconds per routed token copy per MoE layer (routing, permute, finalize)

    # constants only the PyTorch backend's fit frees: the engine era's MoE rows (Mixtral) are too few to pin the MoE
    # ones, and its GPUs (A100, H100) and precisions (FP16, FP8, INT8) span 0.3-2 PFLOPS, too little to pin flop_drop
    PYTORCH_ONLY = ("flop_drop", "expert_eff", "expert_drop", "copy_ns")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def step_time(t: Terms, c: Constants):
    """Seconds of one step (works on numpy arrays of terms)."""
    import numpy as np

    compute = _gemm_time(t, c) + t.attn / c.attn_eff + t.mla_decode / FLASH_MLA_DECODE_EFF
    memory = t.mem / c.bw_eff + t.kv / c.kv_eff
    body = (
        np.maximum(memory, compute)
        + c.serial * np.minimum(memory, compute)
        + t.comm / c.link_eff
        + t.layers * c.layer_us * 1e-6
    )
    body = body + t.seqs * t.layers * c.seq_layer_us * 1e-6 + t.copies * c.copy_ns * 1e-9
    return body * (1 + c.pp_bubble * (t.pp - 1))


def _gemm_time(t: Terms, c: Constants):
    """GEMM seconds: one achieved fraction of peak does not hold from 1 PFLOPS (Hopper FP8, RTX PRO FP4) to 9-15
    PFLOPS (B200/B300 FP4): the same M x N x K tiles finish sooner on the faster unit while the operand loads,
    epilogues and (NVFP4) scale handling between them do not, so the fraction reached falls as the peak rises.
    ``gemm_eff`` is the fraction an infinitely slow unit would reach, ``flop_drop`` the loss per PFLOPS.

    The routed experts' grouped GEMMs have their own rate when ``expert_eff`` is set (the PyTorch backend): one
    launch runs every expert's problem, each only as many rows as tokens were routed to it (tens to a few hundred at
    these batches), so its tiles are mostly partial and it is bound by tile count and operand loads, not by the dense
    rate -- the fit puts it at a flat fraction of the peak (``expert_drop`` ~ 0)."""
    if not c.expert_eff:
        return t.gemm / c.gemm_eff * (1 + c.flop_drop * t.peak_pf)
    return (t.gemm - t.expert_gemm) / c.gemm_eff * (1 + c.flop_drop * t.peak_pf) + t.expert_gemm / c.expert_eff * (
        1 + c.expert_drop * t.peak_pf
    )


def bound(t: Terms, c: Constants) -> str:
    """What dominates a step: 'bandwidth', 'compute', 'communication' or 'overhead'."""
    parts = {
        "bandwidth": t.mem / c.bw_eff + t.kv / c.kv_eff,
        "compute": _gemm_time(t, c) + t.attn / c.attn_eff + t.mla_decode / FLASH_MLA_DECODE_EFF,
        "communication": t.comm / c.link_eff,
        "routing": t.copies * c.copy_ns * 1e-9,
        "overhead": (t.layers * c.layer_us + t.seqs * t.layers * c.seq_layer_us) * 1e-6,
    }
    return max(parts, key=parts.get)


def experts_touched(experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts ``tokens`` uniformly routed tokens hit: E (1 - (1 - k/E)^T)."""
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _pairs(start: int, length: int) -> float:
    """Causal query-key pairs of a chunk of ``length`` tokens starting at position ``start``."""
    return length * start + length * (length + 1) / 2


def _chunked_keys(end: float, chunk: int) -> float:
    """Keys the queries at positions 0 .. end-1 attend to under chunked local attention: position p sees the
    (p mod chunk) + 1 positions of its own chunk so far."""
    q, r = divmod(end, chunk)
    return q * chunk * (chunk + 1) / 2 + r * (r + 1) / 2


def _attended(kind, start: float, length: float) -> float:
    """Query-key pairs of ``length`` new tokens at positions start .. start+length-1 in a layer of ``kind``: causal,
    within chunks (Llama 4's RoPE layers), or at most a sliding window each (a generating token: length 1 at the
    position of its KV length)."""
    if kind.chunk:
        return _chunked_keys(start + length, kind.chunk) - _chunked_keys(start, kind.chunk)
    if kind.window:
        return length * min(start + length, kind.window)
    return _pairs(start, length)


def step_terms(
    d: Deployment, context: Sequence[tuple[int, int]] = (), generation: Iterable[int] = (), sampled: int | None = None
) -> Terms:
    """Raw terms of one step: ``context`` = (start position, chunk length) per context entry, ``generation`` = the
    KV length (tokens already cached) of each generating request. ``sampled`` = rows that go through lm_head
    (default: every generating request and every context entry)."""
    gen = list(generation)
    sampled = len(gen) + len(context) if sampled is None else sampled
    return group_terms(d, [(s, n, 1.0) for s, n in context], [(L, 1.0) for L in gen], sampled)


def group_terms(
    d: Deployment, context: Sequence[tuple[int, int, float]], generation: Sequence[tuple[int, float]], sampled: float
) -> Terms:
    """:func:`step_terms` over groups: (start, length, how many) context chunks, (KV length, how many) generating
    requests -- counts may be fractional (the average step of a steady state)."""
    m, g = d.model, d.gpu
    ctx_tokens = sum(n * c for _, n, c in context)
    tokens = ctx_tokens + sum(c for _, c in generation)
    dp = d.tp if d.attn_dp else 1  # attention data-parallel: each GPU holds 1/dp of the batch
    split = 1 if d.attn_dp else d.tp  # how the dense weights are split
    heads = m.heads / split
    kv_local = d.kv_bytes_per_token / (m.num_layers * d.stage_layers)  # bytes per token per layer per GPU
    frac = d.stage_layers
    bw, peak16, link = g.bandwidth_gbs * GB, g.tflops_16 * TERA, g.link_gbs * GB

    mem = kvr = gemm = attn = comm = expert_gemm = copies = mla_decode = 0.0
    flash_mla = m.mla and g.sm == 90  # generation attention by FlashMLA (FLASH_MLA_DECODE_EFF)
    for k in m.layers:
        n = k.count * frac
        dense_params = (k.attn_params + k.mlp_params) / split
        w = d._weight_bytes(dense_params) if tokens else 0.0
        gemm += n * 2 * tokens / dp * dense_params / d.dense_peak
        if k.experts:
            per_gpu_experts = k.experts / d.ep
            touched = experts_touched(k.experts, k.top_k, tokens) / d.ep
            shard = k.expert_params / max(1, d.tp // d.ep)  # each expert split over the MoE-TP ranks
            w += d._weight_bytes(min(touched, per_gpu_experts) * shard, True)
            # every token's top-k expert work, spread evenly over the tp ranks (EP, MoE-TP or both)
            expert_gemm += n * 2 * tokens * k.top_k * k.expert_params / d.tp / d.expert_peak
            copies += n * tokens * k.top_k / d.tp  # each token's top-k copies, spread over the tp ranks
        attended = sum(_attended(k, L, 1) * c for L, c in generation)  # KV tokens the generating rows read
        ctx_pairs = sum(_attended(k, s, n) * c for s, n, c in context)
        mem += n * w / bw
        kvr += n * attended * kv_local / dp / bw
        gen_attn = n * 2 * heads * (m.qk_dim + m.v_dim) * attended / dp / peak16
        if flash_mla:
            mla_decode += gen_attn
        else:
            attn += gen_attn
        attn += n * 2 * heads * (m.qk_dim + m.v_dim) * ctx_pairs / dp / peak16
        if d.attn_dp and k.experts and d.tp > 1:
            # attention DP, EP or MoE-TP alike: every rank all-gathers all ranks' tokens before its experts and
            # reduce-scatters their output after (the CUTLASS MoE without an MNNVL all-to-all); the payload is counted
            # at 16 bits both ways (docs/reference/perf-model.md: the quantized payload was tried and fits worse)
            comm += n * 2 * tokens * m.hidden * ACT_BYTES * (d.tp - 1) / d.tp / link
        elif d.tp > 1:
            comm += n * 2 * 2 * (d.tp - 1) / d.tp * tokens * m.hidden * ACT_BYTES / link
    if d.pp > 1:  # activations handed to the next stage
        comm += tokens * m.hidden * ACT_BYTES / link
    head = m.vocab * m.hidden / d.tp  # lm_head (16-bit) FLOPs per sampled row, spread over the tp GPUs either way
    mem += m.vocab * m.hidden / d.vocab_split * 2 / bw if tokens else 0.0
    gemm += 2 * sampled * head / peak16 + expert_gemm
    seqs = sum(c for _, c in generation) + sum(c for _, _, c in context)
    return Terms(
        mem, kvr, gemm, attn, comm, seqs, m.num_layers * frac, d.pp, d.gemm_peak / 1e15, expert_gemm, copies, mla_decode
    )
