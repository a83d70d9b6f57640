"""The checkpoint a Medusa engine is built from: the converted base model with the recipe's heads added
(:func:`trtpipe.checkpoint.medusa.write_medusa_checkpoint`, as upstream's ``examples/medusa/convert_checkpoint.py
--medusa_model_dir --num_medusa_heads`` writes it), for trtllm-build and the CPU twin alike."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trtpipe.recipe.schema import Recipe


@contextmanager
def with_medusa_heads(recipe: Recipe, checkpoint_dir: str | Path, scratch: str | Path) -> Iterator[Path]:
    """``checkpoint_dir`` itself unless the recipe is Medusa; then a copy with the heads, in a temporary directory
    under ``scratch`` that is removed afterwards."""
    s = recipe.speculative
    if recipe.target != "engine" or s.decoding_type != "medusa":
        yield Path(checkpoint_dir)
        return
    from trtpipe.checkpoint.medusa import write_medusa_checkpoint
    from trtpipe.recipe.medusa import head_config, num_heads
    from trtpipe.recipe.speculative import draft_dir

    heads = draft_dir(recipe)
    n = num_heads(recipe, head_config(heads))
    Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".medusa-build-", dir=scratch) as tmp:
        yield write_medusa_checkpoint(checkpoint_dir, heads, Path(tmp) / "checkpoint", n, s.max_draft_len)
