"""Calibration and evaluation token batches: local text files, or text the model writes itself (``self``).

Files: ``.txt`` (the whole file is one document), ``.jsonl`` (one record per line), ``.json`` (a list of records or
``{"data": [...]}``); records are strings or objects holding ``text_field``. A directory means every such file
under it, in sorted order. Documents are tokenized with the model's own tokenizer, BOS-prefixed, concatenated
and cut into ``seq_len`` windows; the first ``num_samples`` windows are used (a deterministic choice).
Built-in sets (``prose``, ``code``, ``arithmetic``, ``chat``: :mod:`trtpipe.quant.slices`) need no file either;
each has a held-out evaluation part and a calibration part. A file or directory named like one is written ``./code``.
``self``: ``num_samples`` sequences sampled from BOS with a fixed seed (works offline, with no dataset). It runs
the whole unquantized model on the reference runtime, so for models that do not fit in host memory name a
dataset instead (validation refuses 'self' for them: trtpipe/quant/rules.py; calibration and verification
themselves stay layer by layer either way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from trtpipe.errors import QuantizationError
from trtpipe.quant import slices

SUFFIXES = (".txt", ".jsonl", ".json")


def _records_text(records, field: str, where: str) -> list[str]:
    out = []
    for i, r in enumerate(records):
        if isinstance(r, str):
            out.append(r)
        elif isinstance(r, dict) and isinstance(r.get(field), str):
            out.append(r[field])
        else:
            raise QuantizationError(f"{where}: record {i} has no string field '{field}' (set text_field)")
    return out


def read_texts(path: Path, text_field: str = "text") -> list[str]:
    """Documents of a file or directory (see module docstring)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not files:
            raise QuantizationError(f"{path}: no {'/'.join(SUFFIXES)} files in this directory")
        return [t for f in files for t in read_texts(f, text_field)]
    if not path.is_file():
        raise QuantizationError(f"{path}: not found")
    if path.suffix not in SUFFIXES:
        raise QuantizationError(f"{path}: unsupported file type (use {', '.join(SUFFIXES)})")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".txt":
        return [text] if text.strip() else []
    if path.suffix == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise QuantizationError(f"{path}:{n}: invalid JSON: {exc.msg}") from None
        return _records_text(records, text_field, str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise QuantizationError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if isinstance(data, dict):
        data = data.get("data", data.get("rows", [data]))
    if not isinstance(data, list):
        raise QuantizationError(f"{path}: expected a list of records")
    return _records_text(data, text_field, str(path))


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)  # never run shipped code
    except Exception as exc:  # transformers raises many types; the message names the file
        raise QuantizationError(f"{model_dir}: cannot load the tokenizer: {' '.join(str(exc).split())}") from None


def token_windows(texts: Iterable[str], tokenizer, num_samples: int, seq_len: int, where: str) -> torch.Tensor:
    """``[n, seq_len]`` int64 windows of the concatenated, BOS-prefixed documents (n <= num_samples)."""
    bos = tokenizer.bos_token_id
    ids: list[int] = []
    need = num_samples * seq_len
    for t in texts:
        ids += ([bos] if bos is not None else []) + tokenizer.encode(t, add_special_tokens=False)
        if len(ids) >= need:
            break
    n = min(num_samples, len(ids) // seq_len)
    if n == 0:
        raise QuantizationError(f"{where}: {len(ids)} tokens is less than one sample of seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def self_samples(
    generate_fn: Callable[[list[list[int]], int, int], list[list[int]]], bos: int, num_samples: int, seq_len: int
) -> torch.Tensor:
    """``[num_samples, seq_len]`` sequences the model samples from BOS (``generate_fn(prompts, n, seed)``)."""
    prompts = [[bos] for _ in range(num_samples)]
    new = generate_fn(prompts, seq_len - 1, 0)
    rows = []
    for p, n in zip(prompts, new):
        row = (p + list(n))[:seq_len]
        row += [bos] * (seq_len - len(row))  # a sample that ended early is continued by a new document
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def token_batches(
    spec: str,
    resolve: Callable[[str], Path],
    text_field: str,
    tokenizer,
    num_samples: int,
    seq_len: int,
    generate_fn: Optional[Callable] = None,
    seed: int = 0,
    part: slices.Part = "evaluation",
) -> torch.Tensor:
    """Tokens for a recipe data spec (a path, a built-in set or ``self``); ``part``: which part of a built-in set."""
    if spec == "self":
        if generate_fn is None:
            raise QuantizationError("dataset 'self' needs the model to generate from")
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 1
        return self_samples(lambda prompts, n, _: generate_fn(prompts, n, seed), bos, num_samples, seq_len)
    if slices.is_builtin(spec):
        where = f"built-in set '{spec}' ({part})"
        return token_windows(slices.texts(spec, part, seed, tokenizer, where), tokenizer, num_samples, seq_len, where)
    path = resolve(spec)
    return token_windows(read_texts(path, text_field), tokenizer, num_samples, seq_len, str(path))


@torch.no_grad()
def batched_decode(
    model, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> torch.Tensor:
    """Decode ``new_tokens`` for equal-length ``prompts [B, P]`` in one batch (no end ids): ``[B, new_tokens]``.

    Greedy at temperature 0, else sampling from the full softmax with a seeded generator. One batched forward
    per step through the reference model's KV cache (the per-sequence ``generate`` is far slower for this).
    """
    from trtpipe.runtime.model import KVCache

    gen = torch.Generator().manual_seed(seed)
    cache = KVCache()
    logits = model(prompts, cache=cache, start_pos=0)[:, -1]
    out = []
    pos = prompts.shape[1]
    for _ in range(new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(-1)
        out.append(nxt)
        logits = model(nxt[:, None], cache=cache, start_pos=pos)[:, -1]
        pos += 1
    return torch.stack(out, dim=1)
