"""``trtpipe predict`` and ``trtpipe plan --slo``: a recipe's serving performance, before buying the GPUs.

A recipe gives the model (its config.json), the precision, tp/pp, the GPU and the engine limits; the memory
planner gives the KV pool. The simulator then runs the executor over a closed-loop or Poisson workload with
the fitted ``engine`` constants. Published-table scenarios (``--scenarios``) are predicted row by row:
max-load, static batch and batch-1 rows analytically (:mod:`trtpipe.perf.published`), serving rows by the
simulator; rows the model does not cover get a blank ``predicted``.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Optional

from trtpipe import slo as slo_syntax
from trtpipe.formats.gpus import GPU, get_gpu
from trtpipe.formats.schemes import BY_QUANT_ALGO, BY_RECIPE
from trtpipe.errors import TrtpipeError
from trtpipe.extras import pyplot
from trtpipe.perf.cost import Constants, Deployment
from trtpipe.perf.fit import family, load_constants, predict_rows
from trtpipe.models.trtllm_config import resolve_moe_sizes
from trtpipe.perf.models import model_spec
from trtpipe.perf.published import (
    COLUMNS,
    deployment_of,
    kv_capacity_tokens,
    limits_of,
    read_rows,
    regime,
    to_published_unit,
)
from trtpipe.perf.simulate import CostModelEngine, SimResult, closed_loop, poisson
from trtpipe.serving.config import executor_config

# recipe quantization.algo -> cost-model precision (the scheme table's perf column)
RECIPE_PRECISION = {a: s.perf for a, s in BY_RECIPE.items() if s.perf}


def precision_of(algo: str, dtype: str) -> str:
    """The cost model's precision of a recipe quantized with ``algo`` (unquantized: its 16-bit dtype)."""
    return RECIPE_PRECISION.get(algo, "bf16" if dtype == "bfloat16" else "fp16")


def shipped_precision(info) -> Optional[str]:
    """The cost model's precision of the weights a pre-quantized source ships, which a recipe with ``algo: none``
    serves as stored (DeepSeek-V3's block FP8, a ModelOpt FP8 export, ...): the scheme of the format
    :func:`trtpipe.quant.imported.detect.detect_config` reads from its config; None when the source is not
    quantized, the format is not known, or the scheme's precision is not modelled."""
    from trtpipe.errors import CheckpointError
    from trtpipe.quant.imported.detect import detect_config

    try:
        fmt = detect_config(Path("config.json"), info.raw)
    except CheckpointError:  # an unknown format: validate says so; the prediction stays at the model dtype
        return None
    scheme = BY_QUANT_ALGO.get(fmt.quant_algo) if fmt is not None and fmt.quant_algo else None
    return scheme.perf if scheme is not None else None


@dataclass
class Setup:
    deployment: Deployment
    max_batch_size: int
    max_num_tokens: int
    max_input_len: int
    max_seq_len: int
    kv_tokens: int
    tokens_per_block: int
    chunked: bool
    label: str = ""
    family: str = "engine"  # which fitted constant set predicts it: "engine" or "pytorch" (llmapi recipes)

    def config(self, isl: int, osl: int):
        seq = max(self.max_seq_len, isl + osl)
        # reuse off: benchmark prompts share no prefix (simulate.py), so it would change nothing but the bookkeeping
        return executor_config(
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            max_input_len=max(self.max_input_len, isl),
            max_seq_len=seq,
            kv_tokens=self.kv_tokens,
            tokens_per_block=self.tokens_per_block,
            enable_chunked_context=self.chunked,
            enable_kv_cache_reuse=False,
        )


def _expert_split(recipe_path: Path, overrides: Iterable[str], tp: int) -> list[str]:
    """The MoE sizes of a layout with ``tp`` GPUs instead of the recipe's: each expert split as the recipe splits it
    (its moe_tp; whole experts where that does not divide ``tp``), the experts spread over the rest. Keeping the
    recipe's moe_ep instead would refuse every smaller layout (moe_ep x moe_tp must equal tp), so ``plan --slo``
    never tried gpt-oss-120b (moe_ep 4) on one or two GPUs."""
    from trtpipe.app.validation import load_recipe

    p = load_recipe(recipe_path, list(overrides), check_rules=False).parallel
    if p.moe_ep == -1 and p.moe_tp == -1:
        return []  # no expert parallelism: experts split like the rest (moe_tp = tp)
    keep = resolve_moe_sizes(p.tp, p.moe_ep, p.moe_tp)[1]
    moe_tp = keep if tp % keep == 0 else 1
    return [f"parallel.moe_tp={moe_tp}", f"parallel.moe_ep={tp // moe_tp}"]


def recipe_setup(
    recipe_path: Path,
    overrides: Iterable[str] = (),
    gpu: Optional[str] = None,
    model_config: Optional[Path] = None,
    tp: Optional[int] = None,
) -> Setup:
    """The deployment and engine limits a recipe builds, with the memory planner's KV pool."""
    from trtpipe.app import planning

    ov = list(overrides) + (
        [f"parallel.tp={tp}", f"engine.workers={tp}"] + _expert_split(recipe_path, overrides, tp) if tp else []
    )
    r = planning.resolve(recipe_path, ov, gpu=gpu, model_config=model_config)
    rec = r.recipe
    if not r.plan.fits:
        raise TrtpipeError(f"{recipe_path}: {r.plan.refusal}")
    info = planning.model_info(rec, model_config)
    spec = model_spec(info, rec.name)
    q = rec.quantization
    prec = precision_of(q.algo, rec.model.dtype)
    if q.algo == "none":  # a pre-quantized source, served as stored
        prec = shipped_precision(info) or prec
    kv = q.kv_cache if q.kv_cache != "none" else "fp16"
    p = rec.parallel
    ep = resolve_moe_sizes(p.tp, p.moe_ep, p.moe_tp)[0] if spec.is_moe else 1
    d = Deployment(spec, get_gpu(rec.engine.gpu), prec, kv, p.tp, p.pp, ep, attn_dp=p.attention_dp)
    c = r.build.config
    fam = "pytorch" if rec.target == "llmapi" else "engine"  # the PyTorch backend has its own fitted constants
    weights = f"mxfp4-experts+{prec}" if spec.mxfp4_experts else prec  # gpt-oss: the experts as shipped
    adp = " attention-DP" if p.attention_dp else ""
    label = f"{d.num_gpus}x {d.gpu.key} tp{d.tp} pp{d.pp}{f' ep{ep}' if ep > 1 else ''}{adp} {weights}" + (
        " (PyTorch backend)" if fam == "pytorch" else ""
    )
    # attention DP: each of the tp ranks schedules its own batch under these limits with its own KV pool; the simulator
    # runs them as one scheduler with tp times the limits (as trtpipe.perf.published.max_load_case does)
    ranks = p.tp if p.attention_dp else 1
    return Setup(
        d,
        ranks * c.max_batch_size,
        ranks * c.max_num_tokens,
        c.max_input_len,
        c.max_seq_len,
        ranks * r.plan.kv_blocks * r.plan.tokens_per_block,
        r.plan.tokens_per_block,
        bool(c.plugins.get("use_paged_context_fmha", True)),
        label,
        fam,
    )


def simulate(
    setup: Setup,
    constants: Constants,
    isl: int,
    osl: int,
    concurrency: int = 0,
    rate: float = 0.0,
    num_requests: int = 0,
    seed: int = 0,
) -> SimResult:
    if isl + osl > setup.max_seq_len or isl > setup.max_input_len:
        raise TrtpipeError(
            f"ISL {isl} + OSL {osl} exceed the engine's max_input_len {setup.max_input_len} / "
            f"max_seq_len {setup.max_seq_len}"
        )
    engine = CostModelEngine(setup.deployment, constants)
    cfg = setup.config(isl, osl)
    if rate > 0:
        n = num_requests or max(200, int(rate * 30))
        return poisson(cfg, engine, rate, n, isl, osl, seed)
    conc = concurrency or 1
    n = num_requests or max(4 * conc, 32)
    return closed_loop(cfg, engine, conc, n, isl, osl)


def summary(setup: Setup, res: SimResult) -> dict:
    ms = lambda v: round(v * 1e3, 2)  # noqa: E731
    return {
        "layout": setup.label,
        "gpus": setup.deployment.num_gpus,
        "output_tok_s": round(res.throughput, 1),
        "output_tok_s_per_gpu": round(res.throughput / setup.deployment.num_gpus, 1),
        "ttft_ms": {f"p{q}": ms(res.pct("ttft", q)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(res.pct("itl", q)) for q in (50, 90, 99)},
        "requests": len(res.ttft),
        "steps": res.steps,
        "mean_batch": round(res.mean_batch, 1),
        "step_time_bound": res.step_bound,
        "batch_bound": res.load_bound,
        "step_time_share": {k: round(v / max(sum(res.busy_s.values()), 1e-12), 3) for k, v in res.busy_s.items()},
    }


def same_model_names(spec) -> list[str]:
    """Published model names whose shapes are the recipe's (Llama 3, 3.1 and 3.3 70B share one)."""
    from trtpipe.perf.models import PUBLISHED, published_spec

    return [n for n in PUBLISHED if replace(published_spec(n), name=spec.name) == spec]


def nearest_published(
    rows: list[dict], spec, gpu: GPU, precision: str, isl: int, osl: int, tp: int = 1, k: int = 6, fam: str = ""
) -> list[dict]:
    """The published rows closest to a prediction: same model shapes and GPU, the same precision first, then
    the same runtime family (``fam``: engine or pytorch, if given), then the nearest ISL/OSL and GPU count (log
    distances)."""
    names = set(same_model_names(spec))
    cand = []
    for r in rows:
        if r["model"] not in names or not r["isl"] or not r["osl"]:
            continue
        try:
            d = deployment_of(r)
        except TrtpipeError:
            continue
        if d.gpu.key != gpu.key:
            continue
        dist = abs(math.log(int(r["isl"]) / isl)) + abs(math.log(int(r["osl"]) / osl))
        dist += abs(math.log2(d.tp * d.pp / tp)) + (0 if d.precision == precision else 10)
        dist += 5 if fam and family(r) != fam else 0
        cand.append((dist, r))
    cand.sort(key=lambda x: x[0])
    return [r for _, r in cand[:k]]


# ---- scenarios ----------------------------------------------------------------------------------------------


def _serving_limits(row: dict, d: Deployment, isl: int, osl: int, c: Constants) -> Setup:
    lim = limits_of(row, d, isl, osl)
    return Setup(
        d,
        lim.max_batch_size,
        lim.max_num_tokens,
        isl,
        isl + osl,
        kv_capacity_tokens(d, lim.kv_fraction, c.other_gb, lim.max_num_tokens if d.pytorch_backend else 0)
        // max(1, d.pp),
        64,
        True,
    )


def predict_scenarios(
    rows: list[dict], constants: dict[str, Constants], simulate_serving: bool = True, serving_requests: int = 500
) -> list[Optional[float]]:
    """A predicted value per row in the row's own unit, None where not supported."""
    out = predict_rows(rows, constants)
    if not simulate_serving:
        return out
    cache: dict[tuple, SimResult] = {}
    for i, r in enumerate(rows):
        if out[i] is not None or not regime(r).startswith("serving") or family(r) not in constants:
            continue
        try:
            d = deployment_of(r)
        except TrtpipeError:
            continue
        isl, osl = int(r["isl"] or 0), int(r["osl"] or 0)
        load = r["concurrency_or_batch"]
        if not isl or not osl:
            continue
        c = constants[family(r)]
        key = (r["model"], r["precision"], r["gpu"], r["tp"], r["pp"], r["ep"], r["backend"], isl, osl, load)
        if key not in cache:
            setup = _serving_limits(r, d, isl, osl, c)
            m_rate = re.match(r"request_rate_qps=(\S+)", load)
            m_conc = re.match(r"concurrency=(\d+)", load)
            if m_rate:
                rate = float("inf") if m_rate.group(1) == "INF" else float(m_rate.group(1))
                cache[key] = poisson(setup.config(isl, osl), CostModelEngine(d, c), rate, serving_requests, isl, osl)
            elif m_conc:
                conc = int(m_conc.group(1))
                cache[key] = closed_loop(
                    setup.config(isl, osl), CostModelEngine(d, c), conc, max(4 * conc, 32), isl, osl
                )
            else:
                continue
        res = cache[key]
        m = r["metric"]
        val = {
            "ttft_ms_mean": float(res.ttft.mean() * 1e3) if len(res.ttft) else None,
            "itl_ms_mean": float(res.itl.mean() * 1e3) if len(res.itl) else None,
            "output_tok_s_total": res.throughput,
            "output_tok_s_per_gpu": res.throughput,
            "request_throughput_req_s": len(res.ttft) / res.makespan_s if res.makespan_s else None,
            "total_token_throughput_tok_s": (res.throughput * (isl + osl) / osl),
        }.get(m)
        if val is not None and m.startswith("output_tok_s"):
            val = to_published_unit(r, val)
        out[i] = val
    return out


def write_scenarios(src: Path, dst: Path, constants: dict[str, Constants], simulate_serving: bool = True) -> int:
    """OUT = the same rows, same order, plus ``predicted`` (blank where unsupported). Returns rows predicted."""
    dst = Path(dst)
    if dst.exists():
        raise TrtpipeError(f"{dst}: already exists; choose another --out (nothing is overwritten)")
    rows = read_rows(src)
    preds = predict_scenarios(rows, constants, simulate_serving)
    tmp = dst.with_name(dst.name + ".tmp")
    fields = list(rows[0].keys()) if rows else list(COLUMNS)
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields + ["predicted"], extrasaction="ignore")
            w.writeheader()
            for r, p in zip(rows, preds):
                w.writerow({**r, "predicted": "" if p is None else f"{p:.6g}"})
        tmp.replace(dst)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TrtpipeError(f"{dst}: {exc.strerror}") from None
    return sum(p is not None for p in preds)


# ---- capacity planning ----------------------------------------------------------------------------------------

PLAN_SLO_METRICS = ("ttft", "itl", "e2e")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p99=500ms,itl:50ms`` -> {"ttft_p99": 500.0, "itl": 50.0} (milliseconds), in the one SLO syntax of
    :mod:`trtpipe.slo`: ``METRIC_pQ`` bounds the run's Q-th percentile, a bare ``METRIC`` every request (p100)."""
    return slo_syntax.parse_slo(text, PLAN_SLO_METRICS)


def meets(res: SimResult, slo: dict[str, float]) -> tuple[bool, dict[str, float]]:
    """Whether a run meets every SLO target (milliseconds), and the headroom (target / predicted) of each."""
    head = {}
    for key, target_ms in slo.items():
        metric, q = slo_syntax.split_term(key)
        got_ms = res.pct(metric, 100.0 if q is None else q) * 1e3
        head[key] = target_ms / got_ms if got_ms > 0 else math.inf
    return all(h >= 1 for h in head.values()), head


DEFAULT_PLAN_GPUS = ("a100-sxm-80gb", "l40s-48gb", "h100-sxm-80gb", "h200-141gb", "b200-180gb", "rtx-pro-6000-96gb")
REPLICAS = (1, 2, 3, 4, 6, 8, 12, 16)


def capacity_plan(
    recipe_path: Path,
    slo: dict[str, float],
    rate: float,
    isl: int,
    osl: int,
    overrides: Iterable[str] = (),
    gpus: Optional[list[str]] = None,
    model_config: Optional[Path] = None,
    constants: Optional[Constants] = None,
    num_requests: int = 200,
    log=None,
    precisions: Iterable[str] = (),
) -> list[dict]:
    """For every layout (GPU type x tp, x each of ``precisions`` if given) of the recipe that fits memory and can
    run its precision: the fewest data-parallel replicas (each taking rate / replicas, Poisson) whose simulated latencies meet ``slo``.
    Sorted by total GPUs, then by the GPU's memory bandwidth (a proxy for its price: the catalog has no prices)."""
    fitted = load_constants() if constants is None else None
    for key in gpus or ():  # a typo is bad input, not a layout that "does not fit"
        try:
            get_gpu(key)
        except TrtpipeError as exc:
            raise TrtpipeError(str(exc).replace("engine.gpu:", "--gpus:", 1)) from None
    out = []
    variants = [list(overrides) + [f"quantization.algo={p}"] for p in precisions] or [list(overrides)]
    for key, tp, ov in ((k, t, v) for k in gpus or DEFAULT_PLAN_GPUS for t in (1, 2, 4, 8) for v in variants):
        try:
            setup = recipe_setup(recipe_path, ov, gpu=key, model_config=model_config, tp=tp)
        except TrtpipeError as exc:
            algo = next((o.split("=", 1)[1] for o in ov if o.startswith("quantization.algo=")), "")
            out.append({"layout": f"{tp}x {key} tp{tp} {algo}".strip(), "fits": False, "why": str(exc)})
            continue
        c = constants or fitted[setup.family]
        best = None
        for replicas in REPLICAS:
            res = simulate(setup, c, isl, osl, rate=rate / replicas, num_requests=num_requests)
            ok, head = meets(res, slo)
            best = (replicas, res, ok, head)
            if log:
                log(
                    f"{setup.label} x{replicas}: {'meets' if ok else 'misses'} "
                    f"({', '.join(f'{k} x{v:.2f}' for k, v in head.items())})"
                )
            if ok:
                break
        replicas, res, ok, head = best
        s = summary(setup, res)
        s.update(
            {
                "fits": True,
                "meets_slo": ok,
                "replicas": replicas,
                "total_gpus": replicas * s["gpus"],
                "headroom": {k: round(v, 2) for k, v in head.items()},
                "gpu_key": key,
                "bandwidth_gbs": setup.deployment.gpu.bandwidth_gbs,
                "rate_per_replica": rate / replicas,
            }
        )
        out.append(s)
    fit = [o for o in out if o.get("fits")]
    fit.sort(key=lambda o: (not o["meets_slo"], o["total_gpus"], o["bandwidth_gbs"]))
    return fit + [o for o in out if not o.get("fits")]


def plot_plan(rows: list[dict], path: Path, title: str) -> None:
    """Predicted throughput per GPU against ITL p99 per layout (at its chosen replica count)."""
    plt = pyplot("trtpipe plan --plot")
    if path.exists():
        raise TrtpipeError(f"{path}: already exists; choose another --plot (nothing is overwritten)")
    fig, ax = plt.subplots(figsize=(9, 6))
    for o in rows:
        if not o.get("fits"):
            continue
        x, y = o["itl_ms"]["p99"], o["output_tok_s_per_gpu"]
        ax.scatter(x, y, marker="o" if o["meets_slo"] else "x", color="tab:green" if o["meets_slo"] else "tab:red")
        ax.annotate(f"{o['replicas']}x[{o['layout']}] TTFT99 {o['ttft_ms']['p99']:.0f}ms", (x, y), fontsize=7)
    ax.set_xlabel("predicted ITL p99 (ms)")
    ax.set_ylabel("predicted output tok/s per GPU")
    ax.set_xscale("log")
    ax.set_title(title + "\n(o meets the SLO, x misses at 16 replicas)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
