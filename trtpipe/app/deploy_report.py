"""``trtpipe report RECIPE...``: which build to deploy, in one table and one plot.

For each recipe variant of a model it joins three things trtpipe already measured or predicted:
- accuracy from the verify stage (perplexity increase, KL divergence, top-1 agreement) and whether the
  recipe's accuracy gate passes (an unquantized recipe is the baseline);
- memory from the planner (weights per GPU, KV-cache tokens on the target GPU, full-length sequences);
- serving numbers from the newest ``trtpipe bench`` result of that recipe (TTFT, ITL, output tokens/s);
- and, in a note line, the newest ``trtpipe eval --harness lm-eval`` result (per task: delta, SE, verdict).

Nothing is re-measured here and nothing missing is filled in: a recipe that was never built or benched says
so in its row, with the command that fills the gap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from trtpipe.errors import TrtpipeError
from trtpipe.extras import pyplot
from trtpipe.jsonfile import load_json


def _accuracy(recipe) -> dict:
    """The verify stage's accuracy row of this recipe, and the gate verdict (from the cached artifact)."""
    from trtpipe.pipeline.cache import ArtifactStore
    from trtpipe.pipeline.runner import plan_build
    from trtpipe.app.stage_table import STAGES
    from trtpipe.quant.accuracy import Metrics, check_recipe_gate, limits as gate_limits

    if recipe.quantization.algo == "none" and recipe.quantization.kv_cache == "none":
        return {
            "status": "baseline",
            "ppl_increase_pct": 0.0,
            "kl_divergence": 0.0,
            "top1_agreement": 1.0,
            "gate": "baseline",
        }
    try:
        plans = plan_build(recipe, STAGES)
    except (TrtpipeError, OSError) as exc:
        return {"status": f"cannot plan the build ({exc})"}
    plan = next((p for p in plans if p.name == "verify"), None)
    if plan is None or plan.disabled:
        return {"status": "verify disabled (accuracy.enabled: false)"}
    store = ArtifactStore(recipe.work_path)
    source = "this recipe's verify artifact"
    if plan.cached and plan.key is not None:
        folder = store.path("verify", plan.key)
    else:  # e.g. only a gate threshold changed (it is part of the key): judge the newest measured numbers
        older = sorted((store.path("verify", k) for k in store.keys("verify")), key=lambda p: p.stat().st_mtime)
        if not older:
            return {"status": f"not verified yet (trtpipe build {recipe.path})"}
        folder = older[-1]
        source = f"verify artifact {folder.name} (an earlier key of this recipe: same model, other accuracy settings)"
    doc = load_json(folder / "accuracy.json")
    row = doc["rows"][1]
    acc = recipe.accuracy
    limits = gate_limits(acc)
    slice_rows = {name: [Metrics(**r) for r in s["rows"]] for name, s in (doc.get("slices") or {}).items()}
    try:
        check_recipe_gate(acc, [Metrics(**r) for r in doc["rows"]], slice_rows)
        limited = any(v is not None for sl in [None, *acc.slices] for v in gate_limits(acc, sl).values())
        gate = "pass" if limited else "no limits"
    except TrtpipeError as exc:
        gate = f"FAIL: {str(exc).split(': ', 1)[-1]}"
    cal = recipe.quantization.calibration
    return {
        "status": "verified",
        "source": source,
        "row": row["name"],
        "ppl_increase_pct": row["ppl_increase_pct"],
        "kl_divergence": row["kl_divergence"],
        "top1_agreement": row["top1_agreement"],
        "gate": gate,
        "limits": limits,
        "rows": doc["rows"],
        "slices": doc.get("slices"),
        "eval": {k: doc.get(k) for k in ("eval_data", "num_samples", "seq_len")},
        "calibration": {"dataset": cal.dataset, "num_samples": cal.num_samples, "seq_len": cal.seq_len},
    }


def _memory(recipe_path: Path, overrides: Sequence[str]) -> dict:
    from trtpipe.app.planning import resolve

    try:
        r = resolve(recipe_path, overrides)
    except TrtpipeError as exc:
        return {"status": f"cannot plan ({str(exc).splitlines()[0]})"}
    s = r.plan.summary()
    return {
        "status": "planned",
        "gpu": s["gpu"],
        "tp": s["tp"],
        "pp": s["pp"],
        "fits": s["fits"],
        "weight_bytes_per_gpu": s["weight_bytes_per_gpu"],
        "weights_from": s["weights_from"],
        "kv_dtype": s["kv_dtype"],
        "kv_tokens": s["kv_tokens"],
        "concurrent_sequences": s["concurrent_sequences"],
    }


def newest_bench(recipe) -> Optional[Path]:
    """The newest ``result.json`` under ``<work_dir>/bench`` (by its ``created`` stamp, then file time)."""
    root = recipe.work_path / "bench"
    found = []
    for p in root.rglob("result.json") if root.is_dir() else []:
        try:
            doc = load_json(p, finite=False)
        except (OSError, ValueError):
            continue
        if doc.get("format", "").startswith("trtpipe-bench/"):
            found.append((doc.get("created", ""), p.stat().st_mtime, p))
    return max(found)[2] if found else None


def _bench(recipe, prefer_label: Optional[str] = None) -> dict:
    path = newest_bench(recipe)
    if path is None:
        return {"status": f"not benchmarked (trtpipe bench {recipe.path})"}
    doc = load_json(path, finite=False)
    m = doc["metrics"]

    def st(name, s):
        return m[name][s] if name in m else None

    return {
        "status": "benchmarked",
        "result": str(path),
        "label": doc["label"],
        "engine": ((doc.get("provenance") or {}).get("repo") or {}).get("engine"),
        "isl": doc["load"]["isl"],
        "osl": doc["load"]["osl"],
        "ttft_p50": st("ttft", "p50"),
        "ttft_p99": st("ttft", "p99"),
        "itl_p50": st("itl", "p50"),
        "e2e_p50": st("e2e", "p50"),
        "output_token_throughput": m["output_token_throughput"]["value"],
        "request_throughput": m["request_throughput"]["value"],
        "limiter": (doc.get("server") or {}).get("limiter"),
    }


def _harness(recipe) -> dict:
    """The newest ``trtpipe eval --harness`` result of this recipe (trtpipe.app.harness), as written."""
    from trtpipe.app.harness import newest_result

    path = newest_result(recipe)
    if path is None:
        return {"status": "none"}
    doc = load_json(path, finite=False)
    return {
        "status": "measured",
        "result": str(path),
        **{k: doc.get(k) for k in ("created", "harness", "max_drop", "tasks")},
    }


def harness_line(name: str, h: dict) -> Optional[str]:
    """One note line: each task's metric, reference -> quantized, delta, SE and verdict."""
    if h.get("status") != "measured":
        return None
    parts = []
    for t in h["tasks"]:
        se = "n/a" if t["se"] is None else f"{t['se']:.4f}"
        parts.append(
            f"{t['task']} {t['metric']} {t['reference']:.4f} -> {t['quantized']:.4f} "
            f"(delta {t['delta']:+.4f}, SE {se}, {t['verdict']})"
        )
    gate = "" if h.get("max_drop") is None else f", --max-drop {h['max_drop']:g}"
    return f"{name}: {h['harness']} {h['created']}{gate}: " + "; ".join(parts)


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def render(rows: list[dict]) -> str:
    head = (
        f"{'recipe':<20}{'quant':<10}{'kv':<6}{'ppl +%':>8}{'KL':>9}{'top1':>7}  {'gate':<14}{'weights/GPU':>12}"
        f"{'KV tokens':>11}{'ttft p50':>10}{'itl p50':>9}{'out tok/s':>10}  load"
    )
    lines = [head]
    for r in rows:
        a, mem, b = r["accuracy"], r["memory"], r["bench"]
        gate = a.get("gate") or a["status"]
        w = mem.get("weight_bytes_per_gpu")
        lines.append(
            f"{r['recipe']:<20}{r['quantization']:<10}{r['kv_cache']:<6}{_fmt(a.get('ppl_increase_pct'), '8.3f'):>8}"
            f"{_fmt(a.get('kl_divergence'), '9.5f'):>9}{_fmt(a.get('top1_agreement'), '7.3f'):>7}  {gate[:14]:<14}"
            f"{(_fmt(w / 2**20, '.2f') + ' MiB') if w is not None else '-':>12}{_fmt(mem.get('kv_tokens'), 'd'):>11}"
            f"{_fmt(b.get('ttft_p50'), '10.1f'):>10}{_fmt(b.get('itl_p50'), '9.2f'):>9}"
            f"{_fmt(b.get('output_token_throughput'), '10.1f'):>10}  {b.get('label', '')} {b.get('engine') or ''}"
        )
    notes = []
    for r in rows:
        for part in ("accuracy", "memory", "bench"):
            st = r[part]["status"]
            if st not in ("verified", "baseline", "planned", "benchmarked"):
                notes.append(f"{r['recipe']}: {part}: {st}")
            elif part == "accuracy" and str(r[part].get("gate", "")).startswith("FAIL"):
                notes.append(f"{r['recipe']}: accuracy gate {r[part]['gate']}")
            if part == "accuracy" and r[part].get("source", "").startswith("verify artifact "):
                notes.append(f"{r['recipe']}: accuracy numbers from {r[part]['source']}")
    notes += [line for r in rows if (line := harness_line(r["recipe"], r.get("harness") or {}))]
    gpu = next((r["memory"]["gpu"] for r in rows if r["memory"].get("gpu")), None)
    lines.append(
        f"memory: planner prediction for {gpu or 'the recipe GPU'} (weights per GPU, KV-cache tokens); "
        "latency/throughput: newest trtpipe bench result of each recipe, as measured on its server"
    )
    if any(r["bench"].get("engine") == "cpu-twin" for r in rows):
        notes.append(
            "bench numbers of cpu-twin rows come from trtpipe's PyTorch reference runtime standing in for "
            "TensorRT: they compare the serving pipeline, not the speed of the quantized GPU kernels"
        )
    return "\n".join(lines + notes)


def _pair(with_kv: Optional[float], without_kv: Optional[float], spec: str) -> str:
    """``with (without)`` when the KV cache is quantized and the two differ in print, else one value."""
    a, b = _fmt(with_kv, spec, "skipped"), _fmt(without_kv, spec, "skipped")
    return a if without_kv is None or a == b else f"{a} ({b})"


def accuracy_markdown(rows: list[dict]) -> str:
    """The verify stage's numbers of every quantized recipe as a markdown table (README's accuracy table).

    One row per recipe: the deployed configuration (KV cache quantized when the recipe says so) and, in
    brackets, the same weights with the KV cache unquantized; the reference perplexity is the unquantized
    checkpoint's on the same held-out tokens.
    """
    lines = [
        "| recipe | quantization | KV cache | perplexity | ppl +% | KL | top-1 | greedy match | gate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for r in rows:
        a = r["accuracy"]
        if a["status"] == "baseline":
            continue
        if a["status"] != "verified":
            lines.append(f"| {r['recipe']} | {r['quantization']} | {r['kv_cache']} | {a['status']} | | | | | |")
            continue
        ref, deployed = a["rows"][0], a["rows"][1]
        other = a["rows"][2] if len(a["rows"]) > 2 else {}
        lines.append(
            f"| {r['recipe']} | {r['quantization']} | {r['kv_cache']} "
            f"| {_pair(deployed['perplexity'], other.get('perplexity'), '.4f')} "
            f"| {_pair(deployed['ppl_increase_pct'], other.get('ppl_increase_pct'), '.2f')} "
            f"| {_pair(deployed['kl_divergence'], other.get('kl_divergence'), '.4f')} "
            f"| {_pair(deployed['top1_agreement'], other.get('top1_agreement'), '.3f')} "
            f"| {_pair(deployed['greedy_match_len'], other.get('greedy_match_len'), '.1f')} "
            f"of {_fmt(ref['greedy_match_len'], '.0f')} | {a['gate']} |"
        )
        e, c = a["eval"], a["calibration"]
        notes.append(
            f"{r['recipe']}: unquantized perplexity {ref['perplexity']:.4f}; held-out {e['num_samples']}x"
            f"{e['seq_len']} tokens ({e['eval_data']}), calibration {c['num_samples']}x{c['seq_len']} "
            f"({c['dataset']}); {a.get('source', '')}"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def plot(rows: list[dict], path: Path) -> Optional[Path]:
    """Accuracy cost against serving throughput and memory: one panel each; gate failures in red."""
    plt = pyplot("trtpipe report")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in rows:
        a, mem, b = r["accuracy"], r["memory"], r["bench"]
        ppl = a.get("ppl_increase_pct")
        if ppl is None:
            continue
        color = "tab:red" if str(a.get("gate", "")).startswith("FAIL") else "tab:blue"
        if b.get("output_token_throughput") is not None:
            axes[0].scatter(b["output_token_throughput"], ppl, color=color)
            axes[0].annotate(
                r["recipe"], (b["output_token_throughput"], ppl), fontsize=8, xytext=(4, 4), textcoords="offset points"
            )
        if mem.get("weight_bytes_per_gpu") is not None:
            x = mem["weight_bytes_per_gpu"] / 2**20
            axes[1].scatter(x, ppl, color=color)
            axes[1].annotate(
                f"{r['recipe']} ({mem['kv_tokens']} KV tok)",
                (x, ppl),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
    axes[0].set_xlabel("output tokens/s (newest bench)")
    axes[1].set_xlabel("weights per GPU, MiB (plan)")
    for ax in axes:
        ax.set_ylabel("perplexity increase % (verify)")
        ax.grid(alpha=0.3)
    fig.suptitle(
        "which build to deploy: accuracy cost vs throughput and memory (red: accuracy gate fails)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(recipe_paths: Sequence[Path], overrides: Sequence[str], out: Path) -> dict:
    from trtpipe.app.validation import load_recipe

    pyplot("trtpipe report")  # before any build or file: a missing extra leaves nothing half-written
    rows = []
    for path in recipe_paths:
        recipe = load_recipe(path, overrides, check_rules=False)
        rows.append(
            {
                "recipe": recipe.name,
                "path": str(path),
                "quantization": recipe.quantization.algo,
                "kv_cache": recipe.quantization.kv_cache,
                "accuracy": _accuracy(recipe),
                "memory": _memory(Path(path), overrides),
                "bench": _bench(recipe),
                "harness": _harness(recipe),
            }
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = render(rows)
    png = plot(rows, out / "report.png")
    table = accuracy_markdown(rows)
    doc = {"rows": rows, "text": text, "accuracy_table": table, "plot": str(png)}
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "report.md").write_text("```\n" + text + "\n```\n\n" + table + "\n\n![report](report.png)\n")
    doc["text"] = text + f"\nwritten: {out / 'report.json'}, {out / 'report.md'}, {png}"
    return doc
