"""Accuracy of a quantized checkpoint against the unquantized one, on the reference runtime.

Numbers: perplexity on held-out tokens (both models), KL(unquantized || quantized) of the next-token
distributions, top-1 agreement, and the greedy continuation match length (new tokens until the first
difference). The quantized model is measured twice, with its KV cache quantized and without, so a loss can be
attributed to the weights/activations or to the cache. The recipe's ``accuracy`` gate is checked on the
configuration that will be deployed (KV quantized when the recipe says so).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from trtpipe.errors import AccuracyGateError
from trtpipe.quant import reference  # noqa: F401  (runtime handlers for quantized checkpoints)
from trtpipe.quant.data import batched_decode
from trtpipe.runtime.model import ReferenceModel


@dataclass
class Metrics:
    name: str
    perplexity: float
    ppl_increase_pct: float
    kl_divergence: float
    top1_agreement: float
    greedy_match_len: float


def drop_kv_quant(model: ReferenceModel) -> ReferenceModel:
    """The same model with its KV cache kept in full precision (weights and activations still quantized)."""
    for layer in model.layers:
        for shard in layer.attention:
            shard.kv_quant = None
    return model


def _logits(model: ReferenceModel, tokens: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([model(tokens[i:i + batch]) for i in range(0, len(tokens), batch)])  # [N, T, V]


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


def compare(ref: ReferenceModel, models: dict[str, ReferenceModel], tokens: torch.Tensor, batch: int = 8,
            prompt_len: int = 8, new_tokens: int = 32) -> list[Metrics]:
    """Metrics of the reference itself (first row) and of every model in ``models`` on ``tokens [N, T]``."""
    ref_logits = _logits(ref, tokens, batch)
    ref_ppl = _ppl(ref_logits, tokens)
    prompts = [row[:prompt_len].tolist() for row in tokens]
    ref_greedy = _greedy(ref, prompts, new_tokens)
    ref_logp = F.log_softmax(ref_logits, dim=-1)
    rows = [Metrics("unquantized", ref_ppl, 0.0, 0.0, 1.0, float(new_tokens))]
    for name, m in models.items():
        logits = _logits(m, tokens, batch)
        logp = F.log_softmax(logits, dim=-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
        ppl = _ppl(logits, tokens)
        greedy = _greedy(m, prompts, new_tokens)
        match = sum(_match_len(a, b) for a, b in zip(ref_greedy, greedy)) / len(prompts)
        rows.append(Metrics(name, ppl, 100.0 * (ppl / ref_ppl - 1.0), kl, top1, match))
    return rows


def table(rows: list[Metrics]) -> str:
    """A fixed-width table for people."""
    head = f"{'model':<24} {'ppl':>10} {'ppl +%':>8} {'KL':>10} {'top-1':>7} {'greedy match':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<24} {r.perplexity:>10.4f} {r.ppl_increase_pct:>8.3f} {r.kl_divergence:>10.6f} "
                     f"{r.top1_agreement:>7.4f} {r.greedy_match_len:>13.2f}")
    return "\n".join(lines)


def check_gate(row: Metrics, max_ppl_increase_pct: Optional[float], min_top1_agreement: Optional[float],
               max_kl_divergence: Optional[float]) -> None:
    """Raise :class:`AccuracyGateError` with every failed limit and its measured number."""
    failed = []
    if max_ppl_increase_pct is not None and row.ppl_increase_pct > max_ppl_increase_pct:
        failed.append(f"perplexity +{row.ppl_increase_pct:.3f}% > max_ppl_increase_pct {max_ppl_increase_pct}")
    if min_top1_agreement is not None and row.top1_agreement < min_top1_agreement:
        failed.append(f"top-1 agreement {row.top1_agreement:.4f} < min_top1_agreement {min_top1_agreement}")
    if max_kl_divergence is not None and row.kl_divergence > max_kl_divergence:
        failed.append(f"KL {row.kl_divergence:.6f} > max_kl_divergence {max_kl_divergence}")
    if failed:
        raise AccuracyGateError(f"accuracy gate failed for {row.name}: " + "; ".join(failed))


def write_report(out_dir: Path, rows: list[Metrics], meta: dict) -> None:
    (out_dir / "accuracy.json").write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    (out_dir / "accuracy.txt").write_text(table(rows) + "\n")
