"""A draft head's directory as it is published (Medusa heads, EAGLE-1/2 heads): its config.json and one weights
file, read the same way for every kind of head, each refusal one line naming the head and the file."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json


def read_head_dir(
    head_dir: str | Path, what: str, files: Sequence[str], prefixes: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of the first of ``files`` present (``prefixes`` stripped from their names) and the config.json
    of the head directory ``head_dir``; ``what`` names the head in errors ("Medusa heads", "EAGLE head")."""
    d = Path(head_dir)
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{what}: {d / 'config.json'} not found")
    cfg = load_json(d / "config.json", CheckpointError)
    path = next((d / f for f in files if (d / f).is_file()), None)
    if path is None:
        raise CheckpointError(f"{what}: no {' or '.join(files)} in {d}")
    if path.suffix == ".safetensors":
        raw = load_file(str(path))
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    tensors = {}
    for name, value in raw.items():
        for p in prefixes:
            name = name[len(p) :] if name.startswith(p) else name
        tensors[name] = value
    return tensors, cfg
