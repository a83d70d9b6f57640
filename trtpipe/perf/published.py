"""NVIDIA's published TensorRT-LLM numbers as prediction targets: regimes, deployments and the benchmark methods.

Each published row names a model, precision, GPU, tp/pp/ep, ISL/OSL, a metric and a load ("max-load", "static
batch=N", "request_rate_qps=X", "concurrency=N"). :func:`row_case` turns it into what the model computes:

- max-load (in-flight batching, every request submitted at t=0, uniform ISL/OSL): the steady state of the
  executor's Guaranteed-No-Evict scheduling with ``b`` requests in flight (the engine's max batch size or what
  the KV pool holds, whichever is smaller) and at most ``max_num_tokens`` tokens per step. Requests enter as
  fast as they finish: per step ``g`` generating requests and ``g * isl / (osl - 1)`` context tokens, with
  ``g = min(b (osl-1)/osl, max_num_tokens (osl-1)/(osl-1+isl))``; each step yields ``g osl/(osl-1)`` output
  tokens. The engine limits follow the era's method (0.10 fixed limits, 0.11 tuned table, trtllm-bench's
  heuristic from 0.12 on).
- static batch: one context step for the whole batch, then osl-1 generation steps (gptSessionBenchmark).
- batch-1 TTFT/ITL: one context step of ISL tokens / one generation step.
Rows under open-loop or closed-loop load are served by the simulator (:mod:`trtpipe.perf.simulate`).

A case is a list of (weight, :class:`Terms`): total seconds = sum(weight x step_time(terms)); throughput rows
divide ``numer`` output tokens by it, latency rows report it in ms -- so a fit can evaluate thousands of rows at once.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from trtpipe.formats.gpus import GPU, get_gpu
from trtpipe.errors import TrtpipeError
from trtpipe.perf.cost import Deployment, Terms, group_terms
from trtpipe.perf.models import PUBLISHED, published_spec

COLUMNS = [
    "source_file",
    "commit_or_date",
    "trtllm_version",
    "backend",
    "model",
    "precision",
    "gpu",
    "num_gpus",
    "tp",
    "pp",
    "ep",
    "isl",
    "osl",
    "metric",
    "concurrency_or_batch",
]

# published GPU label (prefix) -> catalog key; first match wins
GPU_LABELS = (
    ("GB300", "gb300-288gb"),
    ("GB200", "gb200-186gb"),
    ("GH200", "gh200-96gb"),
    ("B300", "b300-288gb"),
    ("B200", "b200-180gb"),
    ("H200", "h200-141gb"),
    ("H100", "h100-sxm-80gb"),
    ("A100 SXM", "a100-sxm-80gb"),
    ("A100 PCIe", "a100-pcie-80gb"),
    ("L40S", "l40s-48gb"),
    ("RTX PRO 6000", "rtx-pro-6000-96gb"),
)
# published precision label -> (weights, KV cache); FP8 and FP4 runs used an FP8 KV cache
PRECISION_LABELS = {
    "FP8": ("fp8", "fp8"),
    "FP4": ("fp4", "fp8"),
    "FP16": ("fp16", "fp16"),
    "Mixed (FP16)": ("fp16", "fp16"),
    "BF16": ("bf16", "fp16"),
}
# requests per ISL/OSL in the trtllm-bench / gptManager datasets (PERF method, unchanged 0.11 -> 1.2)
REQUESTS = {
    (128, 128): 30000,
    (128, 2048): 3000,
    (128, 4096): 1500,
    (2048, 128): 3000,
    (2048, 2048): 1500,
    (5000, 500): 1500,
    (1000, 1000): 3000,
    (500, 2000): 3000,
    (20000, 2000): 1000,
    (1000, 2000): 1500,
    (1024, 1024): 3000,
    (8192, 1024): 1500,
    (1024, 8192): 1500,
    (32768, 1024): 1000,
    (1024, 32768): 1000,
}
# 0.11 per-model tuned build limits: (model prefix, tp, "isl/osl" or "") -> (max_num_tokens, max_batch_size)
TUNED_011 = {
    ("GPT-J 6B", 1, ""): (2048, 128),
    ("GPT-J 6B", 1, "128/128"): (2048, 2048),
    ("Falcon 180B", 4, ""): (8192, 4096),
    ("Falcon 180B", 8, ""): (8192, 2048),
    ("Llama 2 7B", 1, ""): (8192, 4096),
    ("Llama 2 70B", 2, ""): (2048, 2048),
    ("Llama 2 70B", 4, ""): (8192, 4096),
    ("Llama 2 70B", 4, "128/4096"): (8192, 256),
    ("Llama 2 70B", 8, ""): (16384, 8192),
    ("Llama 2 70B", 8, "128/2048"): (16384, 1024),
    ("Llama 3 8B", 1, ""): (8192, 2048),
    ("Llama 3 70B", 4, ""): (1024, 2048),
    ("Llama 3 70B", 8, ""): (16384, 8192),
    ("Mixtral 8x7B", 2, ""): (3072, 2048),
    ("Mixtral 8x7B", 4, ""): (8192, 8192),
    ("Mistral 7B", 1, ""): (8192, 4098),
}
# 0.19-1.0 pages: the MoE YAML sets enable_attention_dp: true while the tables state no EP (the LLM API's default
# then splits every expert over the tp ranks: MoE-TP, ep = 1)
MOE_ATTN_DP_PAGES = ("0.19.0", "0.20", "0.21", "1.0")
# the 1.0 page's MoE command passes `--ep $ep_size` while its tables name only TP: expert parallel over the tp ranks,
# the DEP layout the later pages name outright (an assumption: the page never gives $ep_size; fitted better than
# MoE-TP, docs/reference/perf-model.md)
MOE_EP_PAGES = ("1.0",)
THROUGHPUT_METRICS = ("output_tok_s_total", "output_tok_s_per_gpu", "output_tok_s_unspecified")
# The published numbers themselves, shipped with the package; where each was published: data/SOURCES.md
PUBLISHED_CSV = Path(__file__).resolve().parent / "data" / "published_trtllm.csv"


def gpu_of(label: str) -> GPU:
    for prefix, key in GPU_LABELS:
        if label.startswith(prefix):
            return get_gpu(key)
    raise TrtpipeError(f"gpu '{label}': not in the published-label table (trtpipe/perf/published.py GPU_LABELS)")


def _int(s: str, default: int = 0) -> int:
    return int(s) if s and s.strip() else default


def regime(row: dict) -> str:
    """Which published measurement regime a row belongs to (never mix them in one error statistic)."""
    b, load, metric = row["backend"], row["concurrency_or_batch"], row["metric"]
    if load.startswith("max"):
        return ("engine" if b.startswith("engine:") else "pytorch") + " max-load"
    if load.startswith("static batch") or load.startswith("batch 1"):
        if metric.startswith("ttft"):
            return "batch-1 TTFT"
        if metric.startswith("itl"):
            return "batch-1 ITL"
        return "static batch"
    if metric.startswith("ttft") or metric.startswith("itl"):
        return "serving TTFT/ITL"
    return "serving throughput"


def deployment_of(row: dict) -> Deployment:
    if row["model"] not in PUBLISHED:
        raise TrtpipeError(f"model '{row['model']}' has no published config")
    if row["precision"] not in PRECISION_LABELS:
        raise TrtpipeError(f"precision '{row['precision']}' is not modelled")
    w, kv = PRECISION_LABELS[row["precision"]]
    tp, pp, ep = _int(row["tp"], 1), _int(row["pp"], 1), _int(row["ep"], 1)
    spec, gpu = published_spec(row["model"]), gpu_of(row["gpu"])
    attn_dp = "attnDP" in row["backend"] or (
        spec.is_moe and tp > 1 and row["trtllm_version"] in MOE_ATTN_DP_PAGES and row["backend"].startswith("pytorch:")
    )
    if spec.mxfp4_experts and gpu.sm < 100:  # GPT-OSS YAML: FP8 KV on Blackwell, "Hopper: use auto" (BF16)
        kv = "fp16"
    if spec.is_moe and tp > 1 and not row["ep"].strip() and row["trtllm_version"] in MOE_EP_PAGES:
        ep = tp
    return Deployment(spec, gpu, w, kv, tp, pp, ep, attn_dp, pytorch_backend=row["backend"].startswith("pytorch:"))


def _round_batch(b: int) -> int:
    if b < 256:
        return max(64, math.ceil(b / 32) * 32)
    if b < 1024:
        return math.ceil(b / 128) * 128
    return math.ceil(b / 256) * 256


def _round_tokens(t: int) -> int:
    if t < 4096:
        return max(2048, math.ceil(t / 256) * 256)
    if t < 8192:
        return math.ceil(t / 512) * 512
    return math.ceil(t / 1024) * 1024


def bench_heuristic(d: Deployment, isl: int, osl: int, kv_fraction: float = 0.95) -> tuple[int, int]:
    """trtllm-bench's (max_batch_size, max_num_tokens) from dataset statistics and GPU memory (its tuning.py)."""
    weights = d.model.total_params * {"fp4": 0.5, "fp8": 1}.get(d.precision, 2)
    kv_per_token = d.kv_bytes_per_token * d.tp * d.pp
    cache = (d.gpu.memory_bytes * d.num_gpus - weights) * kv_fraction
    fit = int(cache / (kv_per_token * (isl + osl)))
    raw_batch = max(1, min(fit, 4096) // d.pp)
    raw_tokens = min(int(raw_batch * (1 + isl / osl)), 32768)
    return _round_batch(raw_batch), _round_tokens(raw_tokens)


def kv_capacity_tokens(d: Deployment, kv_fraction: float, other_gb: float, max_num_tokens: int = 0) -> int:
    """Tokens the runtime's KV pool holds per pipeline stage: the fraction of memory left after the weights, the
    activations of a ``max_num_tokens`` forward pass (:meth:`Deployment.profiling_activation_bytes`: the PyTorch
    backend sizes its pool after such a pass) and ``other_gb`` (CUDA context, workspaces: a fitted constant)."""
    free = d.gpu.memory_bytes - d.weight_bytes_per_gpu - other_gb * 1e9 - d.profiling_activation_bytes(max_num_tokens)
    return max(0, int(free * kv_fraction / d.kv_bytes_per_token))


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int
    max_num_tokens: int
    kv_fraction: float
    num_requests: int


def limits_of(row: dict, d: Deployment, isl: int, osl: int) -> EngineLimits:
    b, version = row["backend"], row["trtllm_version"]
    n = REQUESTS.get((isl, osl), 1000)
    if b == "engine:IFB-gptManager":
        return EngineLimits(2048, 2048, 0.9, 2000)
    if b == "engine:IFB-gptManager-tuned":
        tp = d.tp
        key = next((k for k in ((row["model"], tp, f"{isl}/{osl}"), (row["model"], tp, "")) if k in TUNED_011), None)
        if key is None:
            mb, mt = bench_heuristic(d, isl, osl, 0.99)
            return EngineLimits(mb, mt, 0.99, n)
        mt, mb = TUNED_011[key]
        return EngineLimits(mb, mt, 0.99, n)
    frac = 0.90 if version in ("0.12.0", "0.13.0", "0.14.0", "0.15.0", "0.16.0") else 0.95
    if b.startswith("pytorch:"):
        return pytorch_limits(d, isl, osl, frac, n)
    mb, mt = bench_heuristic(d, isl, osl, 0.95)
    return EngineLimits(mb, mt, frac, n)


# LLM-API defaults trtllm-bench falls back to when the checkpoint's quantization has no heuristic (BuildConfig)
DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_NUM_TOKENS = 2048, 8192


def pytorch_limits(
    d: Deployment, isl: int, osl: int, kv_fraction: float = 0.95, num_requests: int = 1000
) -> EngineLimits:
    """trtllm-bench's limits on the PyTorch backend (tensorrt_llm/bench/benchmark/utils/general.py get_settings):
    the heuristic for NVFP4/FP8/unquantized checkpoints, the LLM-API defaults for any other quantization (GPT-OSS's
    MXFP4), and -- chunked prefill being off by default there -- a token budget of at least one full prompt plus
    one token per batch slot (``max_isl + max_batch_size``). With attention data parallelism every rank schedules
    its own batch under these limits."""
    if d.model.mxfp4_experts:
        mb, mt = DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_NUM_TOKENS
    else:
        mb, mt = bench_heuristic(d, isl, osl, 0.95)
    return EngineLimits(mb, max(mt, isl + mb), kv_fraction, num_requests)


@dataclass
class Case:
    """How one row's value is computed from step times."""

    parts: list[tuple[float, Terms]] = field(default_factory=list)
    numer: float = 0.0  # output tokens (throughput rows); 0 for latency rows (value = seconds x 1000)
    bound: str = ""  # what limits the load: batch slots, KV capacity, token budget
    note: str = ""


def _simpson(d: Deployment, ctx: list, gen_count: float, isl: int, osl: int, sampled: float, weight: float):
    """Generation KV lengths run from isl to isl+osl over a request's life: Simpson's rule over three steps."""
    out = []
    for frac, w in ((0.0, 1 / 6), (0.5, 4 / 6), (1.0, 1 / 6)):
        kv = int(isl + frac * (osl - 1))
        out.append((weight * w, group_terms(d, ctx, [(kv, gen_count)] if gen_count else [], sampled)))
    return out


def max_load_case(d: Deployment, lim: EngineLimits, isl: int, osl: int, other_gb: float) -> Case:
    act_tokens = lim.max_num_tokens if d.pytorch_backend else 0
    cap = kv_capacity_tokens(d, lim.kv_fraction, other_gb, act_tokens) // (isl + osl)
    if cap < 1:
        raise TrtpipeError(f"one request of {isl}+{osl} tokens does not fit the KV pool")
    ranks = d.tp if d.attn_dp else 1  # attention data parallel: each rank its own scheduler, limits and KV pool
    b = ranks * min(lim.max_batch_size, cap // d.pp if d.pp > 1 else cap)
    bound = "batch slots" if lim.max_batch_size <= cap else "KV capacity"
    if osl <= 1:
        g, c = 0.0, min(ranks * lim.max_num_tokens // isl, b) * isl
        return Case([(1.0, group_terms(d, [(0, isl, c / isl)], [], c / isl))], c / isl, "token budget")
    g_slots = b * (osl - 1) / osl
    g_tokens = ranks * lim.max_num_tokens * (osl - 1) / (osl - 1 + isl)
    if g_tokens < g_slots:
        bound = "token budget"
    g = min(g_slots, g_tokens)
    new = g / (osl - 1)  # requests entering (and leaving) per step
    ctx = [(0, isl, new)]
    return Case(_simpson(d, ctx, g, isl, osl, g + new, 1.0), g + new, bound)


def static_case(d: Deployment, batch: int, isl: int, osl: int) -> Case:
    parts = [(1.0, group_terms(d, [(0, isl, batch)], [], batch))]
    if osl > 1:
        parts += _simpson(d, [], batch, isl, osl, batch, osl - 1)
    return Case(parts, batch * osl, "static batch")


def row_case(row: dict, other_gb: float = 3.5) -> Optional[Case]:
    """The computation for one published row, or None when the analytic path does not cover it."""
    reg = regime(row)
    isl, osl = _int(row["isl"]), _int(row["osl"])
    d = deployment_of(row)
    if reg.endswith("max-load") and row["metric"] in THROUGHPUT_METRICS and isl and osl:
        return max_load_case(d, limits_of(row, d, isl, osl), isl, osl, other_gb)
    if reg == "static batch" and row["metric"] in THROUGHPUT_METRICS and isl and osl:
        m = re.search(r"=(\d+)", row["concurrency_or_batch"])
        return static_case(d, int(m.group(1)), isl, osl) if m else None
    if reg == "batch-1 TTFT" and isl:
        return Case([(1.0, group_terms(d, [(0, isl, 1)], [], 1))], 0.0, "batch 1")
    if reg == "batch-1 ITL" and isl and osl:
        return Case(_simpson(d, [], 1, isl, osl, 1, 1.0), 0.0, "batch 1")
    return None


def published_value(row: dict) -> float:
    """The row's value in the unit the model predicts: total output tok/s for throughput, ms for latency."""
    try:
        v = float(row.get("value") or "nan")
    except ValueError:
        return math.nan
    if row["metric"] == "output_tok_s_per_gpu":
        return v * _int(row["num_gpus"], 1)
    return v


def to_published_unit(row: dict, total: float) -> float:
    if row["metric"] == "output_tok_s_per_gpu":
        return total / _int(row["num_gpus"], 1)
    return total


INTEGER_COLUMNS = ("num_gpus", "tp", "pp", "ep", "isl", "osl")  # blank allowed (unknown), else a whole number


def check_row(path: Path, line: int, number: int, row: dict) -> None:
    """Row ``number`` (1 = the first after the header, ending on ``line``) as ``csv.DictReader`` read it: every
    field present, no extra cell, whole numbers where counts go; else a one-line TrtpipeError naming all three."""
    where = f"{path}:{line}: row {number}"
    if None in row:
        raise TrtpipeError(f"{where}: {len(row) - 1 + len(row[None])} fields, the header has {len(row) - 1}")
    for column in COLUMNS:
        value = row[column]
        if value is None:
            raise TrtpipeError(f"{where}: field '{column}' is missing (the row ends early)")
        if column in INTEGER_COLUMNS and value.strip() and not value.strip().isdigit():
            raise TrtpipeError(f"{where}: field '{column}': expected a whole number, got {value!r}")


def read_rows(path: Path) -> list[dict]:
    """The rows of a published-format CSV (header :data:`COLUMNS`, any extra columns kept), each checked."""
    path = Path(path)
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise TrtpipeError(f"{path}: missing column(s) {', '.join(missing)}")
            rows = []
            for number, row in enumerate(reader, 1):
                check_row(path, reader.line_num, number, row)
                rows.append(row)
            return rows
    except OSError as exc:
        raise TrtpipeError(f"{path}: {exc.strerror}") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise TrtpipeError(f"{path}: not a readable CSV ({exc})") from None
