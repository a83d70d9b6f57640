"""Medusa heads into a TensorRT-LLM checkpoint, as upstream's converter writes them.

``examples/medusa/convert_checkpoint.py`` (``--medusa_model_dir DIR --num_medusa_heads N``, README.md@27712aa7) builds
``MedusaForCausalLm.from_hugging_face`` (``tensorrt_llm/models/medusa/model.py@02499765``): the base model's tensors,
plus, for every head ``h`` and residual block ``l`` (``load_medusa_hf``, ``tensorrt_llm/models/medusa/weight.py``):

- ``medusa_heads.{h}.medusa_layers.{l}.linear.weight`` / ``.bias`` from ``{h}.{l}.linear.weight`` / ``.bias``,
- ``medusa_heads.{h}.lm_head.weight`` from ``{h}.{num_layers}.weight``,

each split along dim 0 over tp (``split(w, tp_size, tp_rank)``: both are ``ColumnLinear`` with ``gather_output``), in
the checkpoint's dtype; config.json gains ``architecture: MedusaForCausalLM``, ``num_medusa_heads``,
``num_medusa_layers`` and ``max_draft_len`` (``MedusaConfig.to_dict``, ``tensorrt_llm/models/medusa/config.py
@084a8843``). Every pp rank holds the heads here (upstream's ``load_medusa_hf`` splits over tp alone; only the last
pp stage's are read). The lm_head rows are padded to a multiple of tp (``pad_vocab_size``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trtpipe.checkpoint.head_files import read_head_dir
from trtpipe.checkpoint.shard import split_even
from trtpipe.checkpoint.writer import atomic_dir, write_json
from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json

ARCHITECTURE = "MedusaForCausalLM"
HEAD_FILES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")  # load_medusa_hf's order
PREFIXES = ("medusa_heads.", "medusa_head.")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def read_heads(heads_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The heads' tensors (FasterDecoding / upstream names, prefixes stripped) and their config.json."""
    return read_head_dir(heads_dir, "Medusa heads", HEAD_FILES, PREFIXES)


def head_tensors(
    t: dict, num_heads: int, num_layers: int, vocab: int, dtype: torch.dtype, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """One tp rank's ``medusa_heads.*`` tensors."""
    out = {}
    for h in range(num_heads):
        for j in range(num_layers):
            for part in ("weight", "bias"):
                name = f"{h}.{j}.linear.{part}"
                if name not in t:
                    raise CheckpointError(f"Medusa heads: tensor '{name}' is missing")
                out[f"medusa_heads.{h}.medusa_layers.{j}.linear.{part}"] = split_even(
                    t[name].to(dtype), 0, rank, tp, name
                )
        name = f"{h}.{num_layers}.weight"
        if name not in t:
            raise CheckpointError(f"Medusa heads: tensor '{name}' (lm_head) is missing")
        lm = t[name][:vocab].to(dtype)
        pad = -lm.shape[0] % tp
        if pad:
            lm = torch.cat([lm, lm.new_zeros(pad, lm.shape[1])])
        out[f"medusa_heads.{h}.lm_head.weight"] = split_even(lm, 0, rank, tp, name)
    return {k: v.contiguous() for k, v in out.items()}


def write_medusa_checkpoint(
    checkpoint_dir: str | Path, heads_dir: str | Path, out_dir: str | Path, num_heads: int, max_draft_len: int
) -> Path:
    """``checkpoint_dir`` with the Medusa heads of ``heads_dir`` added, written atomically to ``out_dir``."""
    src, out = Path(checkpoint_dir), Path(out_dir)
    cfg = load_json(src / "config.json", CheckpointError)
    t, hcfg = read_heads(heads_dir)
    layers = hcfg.get("medusa_num_layers")
    if not isinstance(layers, int):
        raise CheckpointError(f"{Path(heads_dir) / 'config.json'}: 'medusa_num_layers' is missing")
    m = cfg.get("mapping", {})
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    dtype = DTYPES.get(cfg.get("dtype"), torch.float16)
    with atomic_dir(out, overwrite=True) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("rank"):
                shutil.copy2(f, tmp / f.name)
        for r in range(tp * pp):
            tensors = load_file(str(src / f"rank{r}.safetensors"))
            tensors.update(head_tensors(t, num_heads, layers, int(cfg["vocab_size"]), dtype, tp, r % tp))
            save_file(tensors, str(tmp / f"rank{r}.safetensors"), metadata={"format": "pt"})
        cfg = {
            **cfg,
            "architecture": ARCHITECTURE,
            "num_medusa_heads": num_heads,
            "num_medusa_layers": layers,
            "max_draft_len": max_draft_len,
        }
        write_json(tmp / "config.json", cfg)
    return out


def checkpoint_heads(checkpoint_dir: str | Path) -> tuple[dict[str, torch.Tensor], int, int]:
    """The Medusa heads of a MedusaForCausalLM checkpoint in the heads' own names (tp shards gathered), with the
    number of heads and of residual blocks; CheckpointError when it has none."""
    d = Path(checkpoint_dir)
    cfg = load_json(d / "config.json", CheckpointError)
    if cfg.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{d}: architecture {cfg.get('architecture')} is not {ARCHITECTURE}")
    n, layers = int(cfg["num_medusa_heads"]), int(cfg["num_medusa_layers"])
    m = cfg.get("mapping", {})
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    shards = [load_file(str(d / f"rank{(pp - 1) * tp + r}.safetensors")) for r in range(tp)]
    t = {}
    for h in range(n):
        for j in range(layers):
            for part in ("weight", "bias"):
                name = f"medusa_heads.{h}.medusa_layers.{j}.linear.{part}"
                if name not in shards[0]:
                    raise CheckpointError(f"{d}: tensor '{name}' is missing")
                t[f"{h}.{j}.linear.{part}"] = torch.cat([s[name] for s in shards])
        t[f"{h}.{layers}.weight"] = torch.cat([s[f"medusa_heads.{h}.lm_head.weight"] for s in shards])
    return t, n, layers
