"""Medusa in a recipe (``speculative.decoding_type: medusa``, target engine): the checks and the choices tree.

Upstream (TensorRT-LLM's engine path): ``examples/medusa/README.md@27712aa7`` converts the base model with the heads
(``convert_checkpoint.py --medusa_model_dir DIR --num_medusa_heads N``), builds with
``trtllm-build --speculative_decoding_mode medusa --max_draft_len L`` and runs with ``--medusa_choices`` (the tree,
one path of top-k ranks per candidate: 63 nodes for its 4-head Vicuna example, so ``max_draft_len`` is the number of
candidates). ``MedusaForCausalLm`` wraps a LLaMA or QWen base (``tensorrt_llm/models/medusa/model.py@02499765``), and
reads ``medusa_num_heads`` / ``medusa_num_layers`` from the heads' ``config.json`` (the recipe's
``num_medusa_heads`` overrides the first, as ``speculative_config.num_medusa_heads`` does there). Triton's
``tensorrt_llm`` model takes the tree as ``medusa_choices`` in braces, ``"{0, 0, 0}, {0, 1}"``
(``docs/model_config.md@7bc57da0`` of tensorrtllm_backend).

The CPU twin executes the tree (:mod:`trtpipe.serving.medusa`, verified with a tree mask:
:mod:`trtpipe.serving.tree_verify`); choices that are not a tree (a path without its parent) are refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding
from trtpipe.recipe.schema import Recipe

KEY = "speculative"
# upstream's example tree for 4 heads (Medusa's mc_sim_7b_63), as examples/medusa/README.md@27712aa7 runs it with
# --medusa_choices and examples/llm-api/llm_medusa_decoding.py@a7b3f310 with max_draft_len=63, num_medusa_heads=4
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0],
    [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1],
    [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip
HEAD_FILES = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")  # load_medusa_hf's order
BASE_FAMILIES = ("llama", "qwen")  # MedusaForCausalLm's base classes


def chain(k: int) -> list[list[int]]:
    return [[0] * (i + 1) for i in range(k)]


def tree_problem(choices) -> str:
    """Why ``choices`` is not a Medusa tree ("" when it is): non-empty paths of ranks >= 0, no repeats, every
    prefix of a path present."""
    seen = set()
    for c in choices:
        if not c or any(int(i) < 0 for i in c):
            return f"{list(c)} is not a non-empty path of top-k ranks (integers >= 0)"
        if tuple(c) in seen:
            return f"{list(c)} appears twice"
        seen.add(tuple(c))
    for c in choices:
        if len(c) > 1 and tuple(c[:-1]) not in seen:
            return f"{list(c)} has no parent {list(c[:-1])} in the choices"
    return ""


def choices(recipe: Recipe) -> list[list[int]]:
    """The recipe's Medusa tree (the chain of ``max_draft_len`` when unset)."""
    s = recipe.speculative
    return [list(c) for c in s.medusa_choices] if s.medusa_choices else chain(s.max_draft_len)


def braces(tree: list[list[int]]) -> str:
    """A choices tree in the Triton backend's format: ``{0}, {0, 0}`` (medusa_choices and eagle_choices alike)."""
    return ", ".join("{" + ", ".join(str(i) for i in c) + "}" for c in tree)


def triton_choices(recipe: Recipe) -> str:
    """Triton's ``medusa_choices`` parameter: ``{0}, {0, 0}`` ("" unless medusa)."""
    if recipe.speculative.decoding_type != "medusa":
        return ""
    return braces(choices(recipe))


def head_config(path: Path) -> dict:
    """The heads' config.json (``medusa_num_heads``, ``medusa_num_layers``), checked; CheckpointError otherwise."""
    cfg = load_json(path / "config.json", CheckpointError) if (path / "config.json").is_file() else None
    if cfg is None:
        raise CheckpointError(f"Medusa heads: {path / 'config.json'} not found")
    for key in ("medusa_num_heads", "medusa_num_layers"):
        if not isinstance(cfg.get(key), int):
            raise CheckpointError(f"{path / 'config.json'}: '{key}' is missing (upstream's converter reads it)")
    if not any((path / f).is_file() for f in HEAD_FILES):
        raise CheckpointError(f"Medusa heads: no {' or '.join(HEAD_FILES)} in {path}")
    return cfg


def num_heads(recipe: Recipe, cfg: dict) -> int:
    return recipe.speculative.num_medusa_heads or int(cfg["medusa_num_heads"])


def medusa_findings(recipe: Recipe, m: Optional[ModelDims], heads_dir) -> Iterable[Finding]:
    s = recipe.speculative
    if s.decoding_type != "medusa":
        for key in ("num_medusa_heads", "medusa_choices"):
            if getattr(s, key) is not None:
                yield f"{KEY}.{key}", f"only decoding_type medusa takes {key}; remove it"
        return
    tree = choices(recipe)
    problem = tree_problem(tree)
    if problem:
        yield f"{KEY}.medusa_choices", f"not a tree of candidates: {problem}"
        return
    if len(tree) != s.max_draft_len:
        yield (
            f"{KEY}.max_draft_len",
            f"{s.max_draft_len} differs from the {len(tree)} candidates of medusa_choices (trtllm-build needs them equal)",
        )
    if m is not None and not any(f in m.architecture.lower() for f in BASE_FAMILIES):
        yield (
            f"{KEY}.decoding_type",
            f"TensorRT-LLM's Medusa model wraps a LLaMA or QWen base (MedusaForCausalLm); {m.architecture} is neither",
        )
    if heads_dir is None:
        return
    try:
        cfg = head_config(Path(heads_dir))
    except CheckpointError as exc:
        yield f"{KEY}.speculative_model", str(exc)
        return
    depth = max(len(c) for c in tree)
    n = num_heads(recipe, cfg)
    if n > int(cfg["medusa_num_heads"]):
        yield f"{KEY}.num_medusa_heads", f"{n} exceeds the {cfg['medusa_num_heads']} heads in {heads_dir}"
    elif depth > n:
        yield f"{KEY}.medusa_choices", f"a path of depth {depth} needs {depth} heads; {n} are converted"
    width = cfg.get("hidden_size")
    if m is not None and width is not None and int(width) != m.hidden_size:
        yield f"{KEY}.speculative_model", f"Medusa heads: hidden_size {width} differs from the target's {m.hidden_size}"
