"""The ``calibrate``, ``quantize`` and ``verify`` build stages, and the library calls behind the CLI commands.

* calibrate: statistics of the unquantized checkpoint on the recipe's calibration data. Its key holds the
  calibration settings and, only for AWQ algorithms, the group size (the AWQ search result is stored too), so
  switching fp8 -> int8_sq -> a KV-cache change reuses the same artifact.
* quantize: the quantized TRT-LLM checkpoint at the recipe's tp/pp, with the tokenizer files beside it.
* verify: the accuracy report (JSON + table) and the recipe's accuracy gate, before any engine is built or any
  serving configuration is written. It comes after ``export`` because, for a pre-quantized source of the llmapi
  target, what is measured is what that target serves: the export (the source passed through or re-laid out).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from trtpipe.checkpoint.convert import TOKENIZER_FILES
from trtpipe.checkpoint.quant_layouts import ALGOS
from trtpipe.formats.schemes import needs_calibration_data
from trtpipe.pipeline.stage import Stage, StageContext
from trtpipe.quant import accuracy, slices
from trtpipe.quant.calibrate import CalibSettings, calibrate, save_layer_stats, write_meta
from trtpipe.quant.data import batched_decode, load_tokenizer, token_batches
from trtpipe.quant.writer import TrtllmSource, quantize_checkpoint
from trtpipe.recipe.schema import Recipe
from trtpipe.runtime.hf_loader import is_trtllm_checkpoint, load_model, quant_scheme
from trtpipe.jsonfile import load_json

log = logging.getLogger("trtpipe.quant")
EVAL_SEED_OFFSET = 7919  # held-out 'self' samples use another seed than calibration


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def needs_calibration(recipe: Recipe) -> bool:
    return needs_calibration_data(recipe.quantization.algo, recipe.quantization.kv_cache)


def is_quantized(recipe: Recipe) -> bool:
    return recipe.quantization.algo != "none" or recipe.quantization.kv_cache != "none"


def has_trtllm_layout(recipe: Recipe) -> bool:
    """The quantized TRT-LLM checkpoint (and its accuracy gate) exists for this algo (fp8_pc_pt: llmapi only)."""
    return is_quantized(recipe) and recipe.quantization.algo in ("none", *ALGOS)


def awq_group_size(recipe: Recipe) -> Optional[int]:
    a = ALGOS.get(recipe.quantization.algo)
    return recipe.quantization.group_size if a is not None and a.needs_samples else None


def _tokens(
    spec: str,
    recipe: Recipe,
    ckpt_dir: Path,
    num_samples: int,
    seq_len: int,
    seed: int,
    text_field: str,
    part: str = "evaluation",
) -> torch.Tensor:
    """Token samples of a data spec; ``self`` samples the checkpoint ``ckpt_dir`` (TRT-LLM or HF directory) from
    BOS with ``seed``; a built-in set gives its ``part`` (evaluation or calibration)."""
    tokenizer = load_tokenizer(ckpt_dir)
    gen = None
    if spec == "self":
        model = load_model(ckpt_dir)
        gen = lambda prompts, n, s: batched_decode(model, torch.tensor(prompts), n, 1.0, s).tolist()  # noqa: E731
    return token_batches(spec, recipe.resolve, text_field, tokenizer, num_samples, seq_len, gen, seed, part)


def shares(weights: list[float], total: int) -> list[int]:
    """``total`` split by ``weights`` (largest remainder), every part at least one when ``total`` allows."""
    raw = [total * w / sum(weights) for w in weights]
    out = [max(1, int(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True):
        if sum(out) >= total:
            break
        out[i] += 1
    while sum(out) > total and max(out) > 1:
        out[out.index(max(out))] -= 1
    return out


def calibration_tokens(recipe: Recipe, ckpt_dir: Path) -> torch.Tensor:
    """The calibration samples: ``dataset``, or every set of ``mix`` with its share of ``num_samples``."""
    c = recipe.quantization.calibration
    if not c.mix:
        return _tokens(c.dataset, recipe, ckpt_dir, c.num_samples, c.seq_len, c.seed, c.text_field, "calibration")
    counts = shares([m.weight for m in c.mix], c.num_samples)
    return torch.cat(
        [
            _tokens(m.data, recipe, ckpt_dir, k, c.seq_len, c.seed, c.text_field, "calibration")
            for m, k in zip(c.mix, counts)
        ]
    )


def run_calibration(
    recipe: Recipe, ckpt_dir: Path, out_dir: Path, progress: Optional[Callable[[str], None]] = None
) -> dict:
    """Calibrate the unquantized checkpoint ``ckpt_dir``; write ``layer{i}.safetensors`` + ``stats.json``."""
    c = recipe.quantization.calibration
    tokens = calibration_tokens(recipe, ckpt_dir)
    settings = CalibSettings(batch_size=c.batch_size, awq_group_size=awq_group_size(recipe), device=_device(c.device))
    save_file({"tokens": tokens}, str(out_dir / "tokens.safetensors"))
    calibrate(
        TrtllmSource(ckpt_dir),
        tokens,
        settings,
        on_layer=lambda i, st: save_layer_stats(out_dir, i, st),
        progress=progress,
        spill_dir=out_dir,
    )
    meta = {
        "dataset": c.dataset if not c.mix else [{"data": m.data, "weight": m.weight} for m in c.mix],
        "num_samples": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "seed": c.seed,
        "device": settings.device,
        "awq_group_size": settings.awq_group_size,
    }
    write_meta(out_dir, meta)
    return meta


def run_quantization(
    recipe: Recipe,
    ckpt_dir: Path,
    stats_dir: Optional[Path],
    out_dir: Path,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Write the quantized checkpoint (and the tokenizer files) into ``out_dir``; return its config.json."""
    q = recipe.quantization
    cfg = quantize_checkpoint(
        ckpt_dir,
        TrtllmSource(ckpt_dir),
        stats_dir,
        out_dir,
        algo=q.algo,
        kv_cache=q.kv_cache,
        group_size=q.group_size,
        alpha=q.smoothquant_alpha,
        exclude=list(q.exclude),
        progress=progress,
    )
    for name in TOKENIZER_FILES:
        if (ckpt_dir / name).is_file():
            shutil.copyfile(ckpt_dir / name, out_dir / name)
    return cfg


def quant_meta(quant_dir: Path) -> tuple[Optional[str], Optional[str]]:
    """(quantization algorithm or format, KV cache algorithm) of a TRT-LLM or HF checkpoint directory."""
    cfg = load_json(quant_dir / "config.json")
    if is_trtllm_checkpoint(quant_dir):
        q = cfg.get("quantization") or {}
        return q.get("quant_algo"), q.get("kv_cache_quant_algo")
    scheme, q = quant_scheme(quant_dir, cfg)
    return q.get("quant_algo") or scheme, q.get("kv_cache_quant_algo") if scheme == "modelopt" else None


def run_accuracy(
    recipe: Recipe,
    ckpt_dir: Path,
    quant_dir: Path,
    out_dir: Optional[Path] = None,
    gate: bool = True,
    progress: Optional[Callable[[str], None]] = None,
) -> tuple[list[accuracy.Metrics], dict[str, list[accuracy.Metrics]]]:
    """Accuracy report of ``quant_dir`` against ``ckpt_dir``, with the KV cache quantized and without: the
    aggregate rows on ``accuracy.eval_data`` and the rows of every ``accuracy.slices`` entry, all from one pass
    over the checkpoints (the slices' samples are stacked under the aggregate's).

    Layer by layer for two TRT-LLM checkpoints, whole models when either is an HF directory
    (:func:`accuracy.evaluate`); activation buffers spill into ``out_dir`` when large.
    """
    acc, c = recipe.accuracy, recipe.quantization.calibration
    seed = c.seed + EVAL_SEED_OFFSET
    parts = [
        ("", acc.eval_data, _tokens(acc.eval_data, recipe, ckpt_dir, acc.num_samples, acc.seq_len, seed, c.text_field))
    ]
    for sl in acc.slices:
        n = sl.num_samples or acc.num_samples
        parts.append((sl.name, sl.data, _tokens(sl.data, recipe, ckpt_dir, n, acc.seq_len, seed, c.text_field)))
    groups, start = {}, 0
    for name, _, t in parts:
        groups[name] = range(start, start + len(t))
        start += len(t)
    tokens = torch.cat([t for _, _, t in parts])
    got, greedy_skipped = accuracy.evaluate(
        ckpt_dir, quant_dir, tokens, batch=c.batch_size, spill_dir=out_dir, progress=progress, groups=groups
    )
    rows = got.pop("")
    if greedy_skipped:
        log.warning("accuracy: greedy continuation match skipped: %s", greedy_skipped)
    if out_dir is not None:
        algo, kv = quant_meta(quant_dir)
        seq_len = int(tokens.shape[1])
        accuracy.write_report(
            out_dir,
            rows,
            {
                "quant_algo": algo,
                "kv_cache_quant_algo": kv,
                "eval_data": acc.eval_data,
                "num_samples": len(groups[""]),
                "seq_len": seq_len,
            },
            greedy_skipped,
            {
                name: ({"data": data, "num_samples": len(t), "seq_len": seq_len}, got[name])
                for name, data, t in parts[1:]
            },
        )
    if gate:
        accuracy.check_recipe_gate(acc, rows, got)
    return rows, got


# --- stages -------------------------------------------------------------------------------------------------


def _calibrate(ctx: StageContext) -> None:
    with ctx.progress("calibrate", total=None) as bar:
        meta = run_calibration(ctx.recipe, ctx.inputs["checkpoint"], ctx.out_dir, progress=lambda s: bar.advance(1))
    ctx.info.update(meta)


def _quantize(ctx: StageContext) -> None:
    with ctx.progress("quantize", total=None) as bar:
        cfg = run_quantization(
            ctx.recipe,
            ctx.inputs["checkpoint"],
            ctx.inputs.get("calibrate"),
            ctx.out_dir,
            progress=lambda s: bar.advance(1),
        )
    ctx.info.update(
        quantization=cfg["quantization"], bytes=sum(p.stat().st_size for p in ctx.out_dir.glob("rank*.safetensors"))
    )


def served_dir(inputs: dict[str, Path]) -> Path:
    """The quantized model a pre-quantized source deploys: the engine target's converted checkpoint, else the
    llmapi export (the source passed through or re-laid out; the checkpoint stage is off for that target)."""
    from trtpipe.stages.export import HF_DIR

    return inputs["checkpoint"] if "checkpoint" in inputs else inputs["export"] / HF_DIR


def _verify(ctx: StageContext) -> None:
    if "quantize" not in ctx.inputs:  # a pre-quantized source: the checkpoint or export is the quantized model
        try:
            with ctx.progress("verify", total=None) as bar:
                rows = run_imported_accuracy(
                    ctx.recipe, served_dir(ctx.inputs), ctx.out_dir, progress=lambda s: bar.advance(1)
                )
        finally:
            if (ctx.out_dir / "accuracy.txt").exists():
                ctx.log.info("accuracy:\n%s", (ctx.out_dir / "accuracy.txt").read_text())
        ctx.info.update(accuracy=load_json(ctx.out_dir / "accuracy.json"))
        if rows is not None:
            accuracy.check_recipe_gate(ctx.recipe.accuracy, *rows)
        return
    try:
        with ctx.progress("verify", total=None) as bar:
            rows = run_accuracy(
                ctx.recipe,
                ctx.inputs["checkpoint"],
                ctx.inputs["quantize"],
                ctx.out_dir,
                gate=False,
                progress=lambda s: bar.advance(1),
            )
    finally:
        report = ctx.out_dir / "accuracy.txt"
        if report.exists():
            ctx.log.info("accuracy:\n%s", report.read_text())
    ctx.info.update(accuracy=load_json(ctx.out_dir / "accuracy.json")["rows"])
    accuracy.check_recipe_gate(ctx.recipe.accuracy, *rows)


def imported(recipe: Recipe) -> bool:
    """``model.source`` was quantized by someone else (the checkpoint or export artifact is already the quantized
    one), for either target."""
    from trtpipe.stages.checkpoint import imported_format

    return imported_format(recipe) is not None


def reference_dir(recipe: Recipe) -> Path:
    """The local directory of ``accuracy.reference`` (``hf://`` references are fetched into the HF cache)."""
    ref = recipe.accuracy.reference
    if ref.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        return resolve_hf(ref)
    return recipe.resolve(ref)


def run_imported_accuracy(
    recipe: Recipe, quant_dir: Path, out_dir: Path, progress: Optional[Callable[[str], None]] = None
) -> Optional[tuple[list[accuracy.Metrics], dict[str, list[accuracy.Metrics]]]]:
    """A pre-quantized source's report: against ``accuracy.reference`` when the recipe names one, else its
    perplexity alone (None: nothing to gate on). ``quant_dir`` is a TRT-LLM checkpoint (engine target: the
    reference is converted here at the same tp/pp and dtype, then removed) or an HF directory (llmapi target:
    the reference is read as stored, like the export)."""
    acc, c, par = recipe.accuracy, recipe.quantization.calibration, recipe.parallel
    if acc.reference is not None and not is_trtllm_checkpoint(quant_dir):
        return run_accuracy(recipe, reference_dir(recipe), quant_dir, out_dir, gate=False, progress=progress)
    if acc.reference is not None:
        from trtpipe.checkpoint.convert import convert

        ref = out_dir / "reference-checkpoint"
        try:
            convert(
                reference_dir(recipe),
                ref,
                tp=par.tp,
                pp=par.pp,
                dtype=recipe.model.dtype,
                moe_tp=par.moe_tp,
                moe_ep=par.moe_ep,
                allow_pickle=recipe.model.allow_pickle,
            )
            return run_accuracy(recipe, ref, quant_dir, out_dir, gate=False, progress=progress)
        finally:
            shutil.rmtree(ref, ignore_errors=True)
    tokens = _tokens(
        acc.eval_data, recipe, quant_dir, acc.num_samples, acc.seq_len, c.seed + EVAL_SEED_OFFSET, c.text_field
    )
    ppl = accuracy.perplexity(quant_dir, tokens, c.batch_size)
    (out_dir / "accuracy.json").write_text(
        json.dumps(
            {
                "perplexity": ppl,
                "reference": None,
                "num_samples": int(tokens.shape[0]),
                "seq_len": int(tokens.shape[1]),
            },
            indent=2,
        )
        + "\n"
    )
    (out_dir / "accuracy.txt").write_text(
        f"perplexity {ppl:.4f} on {acc.eval_data} (no accuracy.reference: nothing to compare against)\n"
    )
    return None


def _files(recipe: Recipe, specs: list[str]) -> list[Path]:
    return [recipe.resolve(d) for d in specs if d != "self" and not slices.is_builtin(d)]


def calibration_files(recipe: Recipe) -> list[Path]:
    """The calibration data files (a calibration's key: the calibrate stage's, and the draft_engine stage's when it
    quantizes the draft)."""
    return _files(recipe, calibration_specs(recipe))


def calibration_specs(recipe: Recipe) -> list[str]:
    c = recipe.quantization.calibration
    return [m.data for m in c.mix] if c.mix else [c.dataset]


def _eval_specs(recipe: Recipe) -> list[str]:
    return [recipe.accuracy.eval_data] + [sl.data for sl in recipe.accuracy.slices]


def _eval_files(recipe: Recipe) -> list[Path]:
    files = _files(recipe, _eval_specs(recipe))
    ref = recipe.accuracy.reference
    if ref is not None and not ref.startswith("hf://"):
        files += sorted(p for p in recipe.resolve(ref).iterdir() if p.is_file())
    return files


CALIBRATE_STAGE = Stage(
    name="calibrate",
    sections=("quantization.calibration",),
    inputs=("checkpoint",),
    run=_calibrate,
    files=calibration_files,
    enabled=needs_calibration,
    extra_key=lambda recipe: {
        "awq_group_size": awq_group_size(recipe),
        "builtin_data": slices.data_version(calibration_specs(recipe)),
    },
    description="calibration statistics (per-channel amax, KV amax, AWQ scales when needed)",
)

QUANTIZE_STAGE = Stage(
    name="quantize",
    sections=("quantization",),
    inputs=("checkpoint", "calibrate"),
    run=_quantize,
    enabled=has_trtllm_layout,
    description="quantized TensorRT-LLM checkpoint",
)

VERIFY_STAGE = Stage(
    name="verify",
    sections=("accuracy", "quantization.calibration"),
    inputs=("checkpoint", "quantize", "export"),
    run=_verify,
    files=_eval_files,
    extra_key=lambda recipe: {"builtin_data": slices.data_version(_eval_specs(recipe))},
    enabled=lambda recipe: recipe.accuracy.enabled and (has_trtllm_layout(recipe) or imported(recipe)),
    description="accuracy report and gate",
)
