"""The checkpoint an EAGLE engine is built from: the converted base model with the recipe's EAGLE-1/2 head added
(:func:`trtpipe.checkpoint.eagle.write_eagle_checkpoint`, as upstream's ``examples/eagle/convert_checkpoint.py
--eagle_model_dir --num_eagle_layers --max_draft_len`` writes it), for trtllm-build and the CPU twin alike."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from trtpipe.recipe.schema import Recipe


@contextmanager
def with_eagle_head(recipe: Recipe, checkpoint_dir: str | Path, scratch: str | Path) -> Iterator[Path]:
    """``checkpoint_dir`` itself unless the recipe is EAGLE on the engine target; then a copy with the head
    (``num_eagle_layers`` and ``max_non_leaves_per_layer`` from ``eagle_choices``), in a temporary directory under
    ``scratch`` that is removed afterwards."""
    s = recipe.speculative
    if recipe.target != "engine" or s.decoding_type != "eagle":
        yield Path(checkpoint_dir)
        return
    from trtpipe.checkpoint.eagle import write_eagle_checkpoint
    from trtpipe.recipe.eagle import choices, tree_shape
    from trtpipe.recipe.speculative import draft_dir

    layers, non_leaves = tree_shape(choices(recipe))
    Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".eagle-build-", dir=scratch) as tmp:
        yield write_eagle_checkpoint(
            checkpoint_dir, draft_dir(recipe), Path(tmp) / "checkpoint", layers, s.max_draft_len, non_leaves
        )
