"""Accuracy of a quantized checkpoint against the unquantized one, on the reference runtime.

Numbers: perplexity on held-out tokens (both models), KL(unquantized || quantized) of the next-token
distributions, top-1 agreement, and the greedy continuation match length (new tokens until the first
difference). The quantized model is measured twice, with its KV cache quantized and without, so a loss can be
attributed to the weights/activations or to the cache. The recipe's ``accuracy`` gate is checked on the
configuration that will be deployed (KV quantized when the recipe says so).

Host memory (:func:`evaluate`): the teacher-forced numbers run layer by layer, like calibration. The samples are
embedded once per checkpoint; then for each layer the unquantized and the quantized layer are built in turn
from their rank files, every hidden-state stream goes through its layer (the KV-unquantized stream through the
quantized layer with the KV round trip off), and the layer is freed; streams live in activation buffers that
spill to memory-mapped files when large. ln_f + lm_head of both checkpoints then score the streams batch by
batch. The greedy continuation needs autoregressive decoding with a whole model, so it runs (one model at a
time) only when the float32 model fits in host memory (:mod:`trtpipe.quant.hostmem`); otherwise it is reported
as skipped, with the reason. The gate does not read it.

Either side may also be an HF checkpoint directory as stored (the llmapi target's export of a pre-quantized
source, or the unquantized original named by ``accuracy.reference``): those run through the reference runtime's
HF loader (:func:`trtpipe.runtime.hf_loader.load_model`), which has no layer-by-layer reader, so the whole models
are compared (:func:`compare`) and refused, naming the size, when they do not fit in host memory.
"""

from __future__ import annotations

import gc
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open

from trtpipe.errors import AccuracyGateError, CheckpointError, QuantizationError
from trtpipe.quant.calibrate import ActivationBuffer
from trtpipe.quant.data import batched_decode
from trtpipe.quant.hostmem import whole_model_misfit
from trtpipe.quant.writer import CheckpointLayers
from trtpipe.runtime.hf_loader import is_trtllm_checkpoint, load_model
from trtpipe.runtime.loader import embedding_table, lm_head_linears
from trtpipe.runtime.model import DecoderLayer, ReferenceModel, rope_tables


@dataclass
class Metrics:
    name: str
    perplexity: float
    ppl_increase_pct: float
    kl_divergence: float
    top1_agreement: float
    greedy_match_len: Optional[float]  # None: skipped (the report says why)


Groups = dict[str, range]  # named sample ranges of one token tensor (evaluation slices), scored separately


def drop_kv_quant(model: ReferenceModel) -> ReferenceModel:
    """The same model with its KV cache kept in full precision (weights and activations still quantized)."""
    for layer in model.layers:
        for shard in layer.attention:
            shard.kv_quant = None
    return model


def _logits(model: ReferenceModel, tokens: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([model(tokens[i : i + batch]) for i in range(0, len(tokens), batch)])  # [N, T, V]


def _ppl(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return math.exp(nll.item())


def _greedy(model: ReferenceModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    return batched_decode(model, torch.tensor(prompts), n).tolist()


def _match_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(
    ref: ReferenceModel,
    models: dict[str, ReferenceModel],
    tokens: torch.Tensor,
    batch: int = 8,
    prompt_len: int = 8,
    new_tokens: int = 32,
    groups: Optional[Groups] = None,
) -> list[Metrics] | dict[str, list[Metrics]]:
    """Metrics of the reference itself (first row) and of every model in ``models`` on ``tokens [N, T]``, with
    every model whole in memory (the oracle :func:`evaluate` is tested against; small models only). With
    ``groups``, rows per named sample range, as :func:`teacher_forced` gives them."""
    n, t = tokens.shape
    ref_logits = _logits(ref, tokens, batch)
    prompts = [row[:prompt_len].tolist() for row in tokens]
    ref_greedy = _greedy(ref, prompts, new_tokens)
    ref_logp = F.log_softmax(ref_logits, dim=-1)
    nll = {"unquantized": _nll_rows(ref_logits, tokens)}
    kl, top1, match = {}, {}, {}
    for name, m in models.items():
        logits = _logits(m, tokens, batch)
        logp = F.log_softmax(logits, dim=-1)
        kl[name] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double().sum(-1)
        top1[name] = (ref_logits.argmax(-1) == logits.argmax(-1)).double().sum(-1)
        nll[name] = _nll_rows(logits, tokens)
        greedy = _greedy(m, prompts, new_tokens)
        match[name] = [_match_len(a, b) for a, b in zip(ref_greedy, greedy)]
    out = {}
    for g, idx in (groups or {"": range(n)}).items():
        rows = _rows(list(models), nll, kl, top1, idx, t)
        rows[0].greedy_match_len = float(new_tokens)
        for r in rows[1:]:
            r.greedy_match_len = sum(match[r.name][idx.start : idx.stop]) / len(idx)
        out[g] = rows
    return out if groups is not None else out[""]


def perplexity(ckpt_dir: Path, tokens: torch.Tensor, batch: int = 8) -> float:
    """Perplexity of one checkpoint (TRT-LLM or HF directory) on ``tokens [N, T]`` (a pre-quantized source with
    nothing to compare against), with the model whole in memory: refused, naming the size, when it does not fit."""
    why = whole_model_misfit(float32_bytes(ckpt_dir))
    if why:
        raise QuantizationError(
            f"{ckpt_dir}: perplexity alone needs the whole model in memory, and {why}; "
            "set accuracy.reference or accuracy.enabled: false"
        )
    with torch.no_grad():
        return _ppl(_logits(load_model(ckpt_dir), tokens, batch), tokens)


NO_KV = "quantized, KV unquantized"  # the quantized model with its KV cache kept in full precision


def stream_names(kv: Optional[str]) -> list[str]:
    """Row names of the quantized checkpoint: with its KV cache quantized and without, or one row."""
    return [f"quantized, KV {kv}", NO_KV] if kv else ["quantized"]


def _embedder(src: CheckpointLayers) -> ReferenceModel:
    """A :class:`ReferenceModel` without layers that holds only the embedding (first PP rank files)."""
    emb = embedding_table(src.config, src.full, src.ranks(0, "transformer.vocab_embedding."))
    return ReferenceModel(src.config, src.full, emb, [], torch.empty(0), [])


def _scorer(src: CheckpointLayers) -> ReferenceModel:
    """A :class:`ReferenceModel` without layers that holds ln_f + lm_head (last PP rank files; the embedding too
    when lm_head is tied to it)."""
    a = src.full
    last = src.ranks(a.pp - 1, ("lm_head.", "transformer.ln_f."))
    if "transformer.ln_f.weight" not in last[0]:
        raise CheckpointError(f"{src.dir}: tensor 'transformer.ln_f.weight' is missing from the last PP rank")
    tied = "lm_head.weight" not in last[0]
    emb = _embedder(src).embedding if tied else torch.empty(0, a.hidden_size)
    return ReferenceModel(src.config, a, emb, [], last[0]["transformer.ln_f.weight"], lm_head_linears(a, last, emb))


def _set_kv_quant(layer: DecoderLayer, on: bool, saved: list) -> None:
    for shard, fn in zip(layer.attention, saved):
        shard.kv_quant = fn if on else None


def _rows(names: list[str], nll: dict, kl: dict, top1: dict, idx: range, t: int) -> list[Metrics]:
    """Rows of one sample range from per-sample sums (``nll``: every stream; ``kl``/``top1``: quantized ones)."""
    count = len(idx)
    ppl = {s: math.exp(float(v[idx.start : idx.stop].sum()) / (count * (t - 1))) for s, v in nll.items()}
    rows = [Metrics("unquantized", ppl["unquantized"], 0.0, 0.0, 1.0, None)]
    for s in names:
        rows.append(
            Metrics(
                s,
                ppl[s],
                100.0 * (ppl[s] / ppl["unquantized"] - 1.0),
                float(kl[s][idx.start : idx.stop].sum()) / (count * t),
                float(top1[s][idx.start : idx.stop].sum()) / (count * t),
                None,
            )
        )
    return rows


@torch.no_grad()
def teacher_forced(
    ref_dir: Path,
    quant_dir: Path,
    tokens: torch.Tensor,
    batch: int = 8,
    spill_bytes: int = 1 << 30,
    spill_dir: Optional[Path] = None,
    progress: Optional[Callable[[str], None]] = None,
    groups: Optional[Groups] = None,
) -> list[Metrics] | dict[str, list[Metrics]]:
    """Perplexity, KL and top-1 of ``quant_dir`` against ``ref_dir`` on ``tokens [N, T]``, one layer in memory at
    a time (see the module docstring); ``greedy_match_len`` is left None. Rows as :func:`compare` gives them.

    With ``groups`` (named sample ranges: the evaluation slices, stacked into one tensor), the checkpoints are
    still read once, and the rows come back per group: ``{name: rows}``.
    """
    ref, quant = CheckpointLayers(ref_dir), CheckpointLayers(quant_dir)
    for key in ("num_layers", "hidden_size", "vocab_size"):
        if getattr(ref.full, key) != getattr(quant.full, key):
            raise QuantizationError(
                f"{quant.dir}/config.json: {key} {getattr(quant.full, key)} differs from "
                f"{getattr(ref.full, key)} in {ref.dir} (not a quantization of that checkpoint)"
            )
    names = stream_names((quant.full.quantization or {}).get("kv_cache_quant_algo"))
    plan = ((ref, ["unquantized"]), (quant, names))
    n, t = tokens.shape
    bufs = {s: ActivationBuffer((n, t, ref.full.hidden_size), spill_bytes, spill_dir) for s in ["unquantized"] + names}
    try:
        for src, streams in plan:  # embed once per checkpoint
            shell = _embedder(src)
            for lo in range(0, n, batch):
                x = shell.embed(tokens[lo : lo + batch])
                for s in streams:
                    bufs[s].data[lo : lo + batch] = x
            del shell, x
        ropes = {id(src): src.full.ropes() for src, _ in plan}
        cos_sin = {k: rope_tables(r, 0, t) for k, r in ropes.items()}
        for i in range(ref.full.num_layers):
            if progress:
                progress(f"({i + 1}/{ref.full.num_layers}) Evaluating")
            for src, streams in plan:
                # the unquantized layer is converted tensor by tensor as it is read (no second copy)
                layer = DecoderLayer(src.full, src.rank_layer(i, to_float=src is ref), i, ropes[id(src)])
                saved = [shard.kv_quant for shard in layer.attention]
                for s in streams:
                    _set_kv_quant(layer, s != NO_KV, saved)
                    d = bufs[s].data
                    for lo in range(0, n, batch):  # each sample is independent: in place, batch by batch
                        d[lo : lo + batch] = layer(d[lo : lo + batch], 0, None, cos_sin[id(src)])
                del layer, saved
                gc.collect()
        ref_head, quant_head = _scorer(ref), _scorer(quant)
        # per-sample sums (float64), so that any range of samples (a slice) can be scored afterwards
        nll = {s: torch.zeros(n, dtype=torch.float64) for s in bufs}
        kl = {s: torch.zeros(n, dtype=torch.float64) for s in names}
        top1 = {s: torch.zeros(n, dtype=torch.float64) for s in names}
        for lo in range(0, n, batch):
            tok = tokens[lo : lo + batch]
            hi = lo + len(tok)
            ref_logits = ref_head.head(bufs["unquantized"].data[lo:hi]).float()
            ref_logp = F.log_softmax(ref_logits, dim=-1)
            nll["unquantized"][lo:hi] = _nll_rows(ref_logits, tok)
            for s in names:
                logits = quant_head.head(bufs[s].data[lo:hi]).float()
                logp = F.log_softmax(logits, dim=-1)
                kl[s][lo:hi] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double().sum(-1)
                top1[s][lo:hi] = (ref_logits.argmax(-1) == logits.argmax(-1)).double().sum(-1)
                nll[s][lo:hi] = _nll_rows(logits, tok)
    finally:
        for b in bufs.values():
            b.close()
    if groups is None:
        return _rows(names, nll, kl, top1, range(n), t)
    return {g: _rows(names, nll, kl, top1, idx, t) for g, idx in groups.items()}


def _nll_rows(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood summed per sample (float64): ``[B]``."""
    b, t, v = logits.shape
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1), reduction="none")
    return per_token.view(b, t - 1).double().sum(-1)


PACKED = {"I32": 8, "U8": 2}  # int4 codes per int32 word (GPTQ / AWQ qweight), 4-bit codes per byte (NVFP4 / MXFP4)


def float32_bytes(ckpt_dir: Path) -> int:
    """4 bytes x every element of the checkpoint's weight files: about what :func:`load_model` holds. In an HF
    directory packed 4-bit tensors count every code they hold (their dequantized weight is what is held)."""
    d = Path(ckpt_dir)
    trtllm = is_trtllm_checkpoint(d)
    n = 0
    for path in sorted(d.glob("rank*.safetensors" if trtllm else "*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                n += math.prod(sl.get_shape()) * (1 if trtllm else PACKED.get(sl.get_dtype(), 1))
    return 4 * n


def greedy_matches(
    ref_dir: Path,
    quant_dir: Path,
    tokens: torch.Tensor,
    prompt_len: int = 8,
    new_tokens: int = 32,
    groups: Optional[Groups] = None,
) -> dict[str, float] | dict[str, dict[str, float]]:
    """Mean greedy continuation match length per quantized row name (per group with ``groups``); one whole model
    in memory at a time."""
    prompts = [row[:prompt_len].tolist() for row in tokens]
    model = load_model(ref_dir)
    ref_greedy = _greedy(model, prompts, new_tokens)
    del model
    gc.collect()
    model = load_model(quant_dir)
    per = {}
    for name in stream_names((model.config.get("quantization") or {}).get("kv_cache_quant_algo")):
        if name == NO_KV:
            drop_kv_quant(model)
        per[name] = [_match_len(a, b) for a, b in zip(ref_greedy, _greedy(model, prompts, new_tokens))]
    out = {
        g: {name: sum(v[idx.start : idx.stop]) / len(idx) for name, v in per.items()}
        for g, idx in (groups or {"": range(len(prompts))}).items()
    }
    return out if groups is not None else out[""]


def evaluate(
    ref_dir: Path,
    quant_dir: Path,
    tokens: torch.Tensor,
    batch: int = 8,
    spill_dir: Optional[Path] = None,
    progress: Optional[Callable[[str], None]] = None,
    prompt_len: int = 8,
    new_tokens: int = 32,
    groups: Optional[Groups] = None,
) -> tuple[list[Metrics] | dict[str, list[Metrics]], Optional[str]]:
    """:func:`teacher_forced` rows plus the greedy match length when the whole float32 model fits in host memory.

    Either directory may be an HF checkpoint (see the module docstring): then the whole models are compared.
    With ``groups``, the rows come per named sample range (``{name: rows}``), from one pass over the checkpoints.

    Returns:
        The rows (reference first) and, when the greedy continuation was skipped, why (else None).
    """
    if not (is_trtllm_checkpoint(ref_dir) and is_trtllm_checkpoint(quant_dir)):
        return whole_models(ref_dir, quant_dir, tokens, batch, prompt_len, new_tokens, groups), None
    got = teacher_forced(ref_dir, quant_dir, tokens, batch, spill_dir=spill_dir, progress=progress, groups=groups)
    skipped = whole_model_misfit(float32_bytes(ref_dir))
    if skipped is None:
        matches = greedy_matches(ref_dir, quant_dir, tokens, prompt_len, new_tokens, groups)
        for g, rows in got.items() if groups is not None else [("", got)]:
            m = matches[g] if groups is not None else matches
            rows[0].greedy_match_len = float(new_tokens)
            for r in rows[1:]:
                r.greedy_match_len = m[r.name]
    return got, skipped


@torch.no_grad()
def whole_models(
    ref_dir: Path,
    quant_dir: Path,
    tokens: torch.Tensor,
    batch: int = 8,
    prompt_len: int = 8,
    new_tokens: int = 32,
    groups: Optional[Groups] = None,
) -> list[Metrics] | dict[str, list[Metrics]]:
    """:func:`compare` of two directories of either kind, with the quantized model's rows as
    :func:`teacher_forced` names them (KV quantized and not); refused, naming the size, when they do not fit."""
    why = whole_model_misfit(float32_bytes(ref_dir) + 2 * float32_bytes(quant_dir))
    if why:
        raise QuantizationError(
            f"{quant_dir}: comparing with {ref_dir} needs both models whole in memory, and "
            f"{why}; set accuracy.enabled: false"
        )
    quant = load_model(quant_dir)
    names = stream_names((quant.config.get("quantization") or {}).get("kv_cache_quant_algo"))
    models = {names[0]: quant}
    if len(names) > 1:
        models[NO_KV] = drop_kv_quant(load_model(quant_dir))
    return compare(load_model(ref_dir), models, tokens, batch, prompt_len, new_tokens, groups)


def table(rows: list[Metrics], note: Optional[str] = None) -> str:
    """A fixed-width table for people; ``note``: why the greedy match was skipped."""
    head = f"{'model':<24} {'ppl':>10} {'ppl +%':>8} {'KL':>10} {'top-1':>7} {'greedy match':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        greedy = "skipped" if r.greedy_match_len is None else f"{r.greedy_match_len:.2f}"
        lines.append(
            f"{r.name:<24} {r.perplexity:>10.4f} {r.ppl_increase_pct:>8.3f} {r.kl_divergence:>10.6f} "
            f"{r.top1_agreement:>7.4f} {greedy:>13}"
        )
    if any(r.greedy_match_len is None for r in rows) and note:
        lines.append(f"greedy match skipped: {note}")
    return "\n".join(lines)


def check_gate(
    row: Metrics,
    max_ppl_increase_pct: Optional[float],
    min_top1_agreement: Optional[float],
    max_kl_divergence: Optional[float],
    where: str = "",
) -> None:
    """Raise :class:`AccuracyGateError` with every failed limit and its measured number; ``where`` names the
    slice and its recipe key (e.g. ``slice 'code' (accuracy.slices[1])``)."""
    failed = []
    if max_ppl_increase_pct is not None and row.ppl_increase_pct > max_ppl_increase_pct:
        failed.append(f"perplexity +{row.ppl_increase_pct:.3f}% > max_ppl_increase_pct {max_ppl_increase_pct}")
    if min_top1_agreement is not None and row.top1_agreement < min_top1_agreement:
        failed.append(f"top-1 agreement {row.top1_agreement:.4f} < min_top1_agreement {min_top1_agreement}")
    if max_kl_divergence is not None and row.kl_divergence > max_kl_divergence:
        failed.append(f"KL {row.kl_divergence:.6f} > max_kl_divergence {max_kl_divergence}")
    if failed:
        raise AccuracyGateError(
            f"accuracy gate failed for {where + ', ' if where else ''}{row.name}: " + "; ".join(failed)
        )


LIMITS = ("max_ppl_increase_pct", "min_top1_agreement", "max_kl_divergence")


def limits(acc, sl=None) -> dict[str, Optional[float]]:
    """The gate's limits of the recipe's ``accuracy`` section, or of its slice ``sl`` (a limit the slice leaves
    out is the section's)."""
    return {k: getattr(acc, k) if sl is None or getattr(sl, k) is None else getattr(sl, k) for k in LIMITS}


def check_recipe_gate(acc, rows: list[Metrics], slices: Optional[dict[str, list[Metrics]]] = None) -> None:
    """The recipe's whole gate: the aggregate rows against ``accuracy``'s limits, then every slice against its
    own; the deployed configuration is the first quantized row (KV quantized when the recipe says so)."""
    check_gate(rows[1], **limits(acc))
    for i, sl in enumerate(acc.slices):
        if slices and sl.name in slices:
            check_gate(slices[sl.name][1], **limits(acc, sl), where=f"slice '{sl.name}' (accuracy.slices[{i}])")


def write_report(
    out_dir: Path,
    rows: list[Metrics],
    meta: dict,
    greedy_skipped: Optional[str] = None,
    slices: Optional[dict[str, tuple[dict, list[Metrics]]]] = None,
) -> None:
    """accuracy.json (``greedy_skipped``: why the greedy match is null, or null) and accuracy.txt; ``slices``:
    ``{name: (meta, rows)}`` of every evaluation slice, after the aggregate rows."""
    doc = {**meta, "greedy_skipped": greedy_skipped, "rows": [asdict(r) for r in rows]}
    text = table(rows, greedy_skipped)
    if slices:
        doc["slices"] = {name: {**m, "rows": [asdict(r) for r in r_]} for name, (m, r_) in slices.items()}
        for name, (m, r_) in slices.items():
            text += f"\n\nslice {name} ({m['data']}, {m['num_samples']} x {m['seq_len']} tokens)\n" + table(r_)
    (out_dir / "accuracy.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "accuracy.txt").write_text(text + "\n")
