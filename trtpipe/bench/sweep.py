"""A sweep: several load points against one server, then the plots and the data behind them.

Each point is a full :func:`~trtpipe.bench.run.run_point` (its own ``result.json``). The sweep writes
``sweep.json`` and ``sweep.csv`` (one row per point: throughput, TTFT/ITL/E2E percentiles, goodput, the
server's limiter) and three PNGs: throughput vs latency percentiles (the Pareto view), latency CDFs, and
per-user speed vs throughput. Every point on the plots is labelled with its load and what the server says
limits it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from trtpipe.bench.aiperf import Load
from trtpipe.bench.run import load_result, run_point
from trtpipe.extras import pyplot
from trtpipe.bench.metrics import BenchError
from trtpipe.jsonfile import load_json

COLUMNS = (
    "label",
    "concurrency",
    "request_rate",
    "ok",
    "failed",
    "request_throughput",
    "output_token_throughput",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "e2e_p50",
    "e2e_p99",
    "goodput",
    "good_request_fraction",
    "limiter",
    "limiter_model",
    "evidence",
)


def row(doc: dict) -> dict:
    m = doc["metrics"]

    def stat(name, s):
        return m[name][s] if name in m else None

    def value(name):
        return m[name]["value"] if name in m else None

    view = doc.get("server") or {}
    return {
        "label": doc["label"],
        "concurrency": doc["load"].get("concurrency"),
        "request_rate": doc["load"].get("request_rate"),
        "ok": doc["run"]["ok"],
        "failed": doc["run"]["failed"],
        "request_throughput": value("request_throughput"),
        "output_token_throughput": value("output_token_throughput"),
        "ttft_p50": stat("ttft", "p50"),
        "ttft_p90": stat("ttft", "p90"),
        "ttft_p99": stat("ttft", "p99"),
        "itl_p50": stat("itl", "p50"),
        "itl_p99": stat("itl", "p99"),
        "e2e_p50": stat("e2e", "p50"),
        "e2e_p99": stat("e2e", "p99"),
        "goodput": value("goodput"),
        "good_request_fraction": value("good_request_fraction"),
        "limiter": view.get("limiter"),
        "limiter_model": view.get("model"),
        "evidence": view.get("evidence"),
    }


def run_sweep(
    target,
    loads: Sequence[Load],
    out_dir: Path,
    slo: Optional[dict] = None,
    recipe=None,
    log: Callable[[str], None] = print,
    **kw,
) -> dict:
    """Run every load point in order into ``out_dir/<label>/``; write the sweep files and plots."""
    out_dir = Path(out_dir)
    docs = []
    for load in loads:
        doc = run_point(target, load, out_dir / load.label(), slo, recipe, **kw)
        r = row(doc)
        log(
            f"{r['label']}: {r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} tok/s, "
            f"ttft p50 {r['ttft_p50']:.1f} ms p99 {r['ttft_p99']:.1f} ms, limiter {r['limiter']}"
        )
        docs.append(doc)
    return write_sweep(out_dir, docs)


def write_sweep(out_dir: Path, docs: list[dict]) -> dict:
    rows = [row(d) for d in docs]
    with open(out_dir / "sweep.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plots = plot_sweep(out_dir, docs)
    index = {
        "points": rows,
        "results": [f"{d['label']}/result.json" for d in docs],  # relative: the dir can move
        "plots": [str(p) for p in plots],
    }
    (out_dir / "sweep.json").write_text(json.dumps(index, indent=1) + "\n")
    return index


def load_sweep(out_dir: Path, relabel: bool = True) -> list[dict]:
    """The results of a sweep; ``relabel`` re-derives each point's limiter from its stored server view."""
    from trtpipe.bench.server_view import limiter

    index = load_json(Path(out_dir) / "sweep.json", BenchError, finite=False)
    docs = [load_result(Path(out_dir) / p) for p in index["results"]]
    for d in docs if relabel else []:
        view = d.get("server")
        if view:
            view.setdefault("client_e2e_ms", d["metrics"]["e2e"]["avg"])
            for k in ("limiter", "model", "evidence"):
                view.pop(k, None)
            view.update(limiter(view))
    return docs


def _cdf(ax, values, label):
    v = np.sort(np.asarray(values, dtype=float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def plot_sweep(out_dir: Path, docs: list[dict]) -> list[Path]:
    """PNG plots of a sweep (matplotlib, no display needed)."""
    plt = pyplot("trtpipe bench (sweep plots)")
    rows = [row(d) for d in docs]
    title = _title(docs[0]) if docs else ""
    x = [r["output_token_throughput"] for r in rows]
    out = []

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            y = [r.get(f"{metric}_{stat}") for r in rows]
            if any(v is not None for v in y):
                ax.plot(x, [np.nan if v is None else v for v in y], style, label=f"{name} {stat}")
        for r in rows:
            y = r.get(f"{metric}_p99")
            if y is not None:
                ax.annotate(
                    f"{r['label']}\n{_limit(r)}",
                    (r["output_token_throughput"], y),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
        ax.set_xlabel("output tokens/s (sum over requests / duration)")
        ax.set_ylabel(f"{name} ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"throughput vs latency {title}", fontsize=10)
    fig.tight_layout()
    out.append(out_dir / "throughput_latency.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "e2e", "E2E latency")):
        for d in docs:
            _cdf(ax, d["samples"].get(metric, []), d["label"])
        ax.set_xlabel(f"{name} ms")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"latency CDFs {title}", fontsize=10)
    fig.tight_layout()
    out.append(out_dir / "latency_cdf.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    users = [(d["metrics"]["user_tps"]["p50"] if "user_tps" in d["metrics"] else np.nan) for d in docs]
    ax.plot(users, x, "o-")
    for r, u in zip(rows, users):
        ax.annotate(
            f"{r['label']} ({_limit(r)})",
            (u, r["output_token_throughput"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4),
        )
    ax.set_xlabel("tokens/s per user, p50 (1000 / itl)")
    ax.set_ylabel("output tokens/s (all users)")
    ax.grid(alpha=0.3)
    ax.set_title(f"Pareto: per-user speed vs total throughput {title}", fontsize=10)
    fig.tight_layout()
    out.append(out_dir / "pareto.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out


def _limit(r: dict) -> str:
    return f"{r['limiter']} @ {r['limiter_model']}" if r.get("limiter_model") else str(r["limiter"])


def _title(doc: dict) -> str:
    rec = (doc.get("provenance") or {}).get("recipe") or {}
    repo = (doc.get("provenance") or {}).get("repo") or {}
    load = doc["load"]
    name = rec.get("name") or doc["target"]["model"]
    return f"({name}, {repo.get('engine', '?')}, ISL {load['isl']} / OSL {load['osl']})"
