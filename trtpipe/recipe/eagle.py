"""EAGLE-1/2 in a recipe (``speculative.decoding_type: eagle``, target engine): the checks and the draft tree.

Upstream (TensorRT-LLM's engine path): ``examples/eagle/convert_checkpoint.py@04a2cacb`` converts the base model
with the head (``--eagle_model_dir DIR --num_eagle_layers N --max_draft_len L``: N the depth of the tree, L its
number of draft tokens) into an ``EagleForCausalLM`` checkpoint, which ``trtllm-build --speculative_decoding_mode
eagle --max_draft_len L`` builds (``tensorrt_llm/commands/build.py@65f1d153``). ``EagleForCausalLM`` extends
``LLaMAForCausalLM`` (``tensorrt_llm/models/eagle/model.py@89fd9b74``): the target is a Llama. The tree is
``eagle_choices`` (paths of top-k ranks, every prefix present: ``EagleDecodingConfig.check_eagle_choices`` in
``tensorrt_llm/llmapi/llm_args.py``), given to Triton's ``tensorrt_llm`` model as ``eagle_choices`` in the backend's
brace format. EAGLE-2's dynamic tree is ``use_dynamic_tree`` with ``dynamic_tree_max_topK`` (same class, "Mutually
exclusive with eagle_choices"; the llm_args revision the code index holds records no commit), which the executor's
``EagleConfig`` takes and the engine reads as runtime inputs (``prepare_inputs`` of model.py@89fd9b74): not a build
flag; but Triton's ``tensorrt_llm`` model builds ``trtllm.EagleConfig(eagle_choices)`` from the ``eagle_choices``
parameter alone (``get_decoding_config``, tensorrtllm_backend ``all_models/inflight_batcher_llm/tensorrt_llm/1/
model.py@01200cc4``), so the engine target cannot turn it on and the recipe refuses it.

The CPU twin drafts the chain ``[[0], [0, 0], ...]`` and static trees with siblings (:mod:`trtpipe.serving.eagle1`,
verified with a tree mask: :mod:`trtpipe.serving.tree_verify`).

EAGLE-3 (``decoding_type: Eagle3``, target llmapi) takes ``eagle_choices`` too, as the PyTorch backend runs it:
``EagleDecodingConfig.validate_eagle_config`` (``tensorrt_llm/llmapi/llm_args.py``, a 2026 revision whose commit the
code index does not record) sorts and checks the choices, resets ``max_draft_len`` to the tree's depth and sets
``max_total_draft_tokens`` to their number; only the two-model form drafts the tree: ``get_spec_metadata`` gives
``eagle_choices`` / ``is_spec_dec_tree`` to the two-model ``Eagle3SpecMetadata`` alone, the one-model metadata
getting none (``tensorrt_llm/_torch/speculative/utils.py@3e906a0e``), and a later utils.py says so ("the one-model
drafter never builds the tree ... Tree-aware acceptance only exists in the two-model TorchSampler path"); the tree's
drafter layers are ``SpecTreeManager``'s (``spec_tree_manager.py@040bc9a2``). So trtpipe refuses eagle_choices with
``eagle3_one_model: true`` in one line. EAGLE-2's dynamic tree (``use_dynamic_tree`` with ``dynamic_tree_max_topK``
and ``max_total_draft_tokens``) runs upstream in the one-model form in recent revisions
(``Eagle3OneModelDynamicTreeWorker``, ``tensorrt_llm/_torch/speculative/eagle3_dynamic_tree.py@470bb720``, picked by
``get_spec_worker`` in ``utils.py`` for the one-model EAGLE-3); trtpipe accepts it there, for llmapi 1.3 (the first
release that has it is unconfirmed), writes upstream's keys with ``max_draft_len`` the depth as upstream's, and the
twin drafts it (:mod:`trtpipe.serving.dynamic_tree`); every other combination is refused in one line. For a static
tree the recipe's ``max_draft_len`` is the tree's number of draft tokens (what the planner and the twin reserve);
the YAML writes upstream's spelling: ``max_draft_len`` the depth and ``eagle_choices``. Upstream marks eagle_choices and the
two-model form deprecated for removal in 1.4 (same llm_args revision).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.lookahead import draft_len
from trtpipe.recipe.medusa import braces, chain
from trtpipe.recipe.rules import Finding
from trtpipe.recipe.schema import Recipe

KEY = "speculative"
KEYS = ("eagle_choices", "dynamic_tree_max_top_k", "max_total_draft_tokens")
EAGLE3_TREE_RELEASES = frozenset(("1.2", "1.3"))  # llmapi.version values that get EAGLE-3's eagle_choices
# llmapi.version values that get EAGLE-3's dynamic tree: the first release with Eagle3OneModelDynamicTreeWorker is
# unconfirmed (the code index holds it at TensorRT-LLM commit 470bb720, whose version.py it does not hold)
EAGLE3_DYNAMIC_TREE_RELEASES = frozenset(("1.3",))
HEAD_FILES = ("pytorch_model.bin", "model.safetensors")  # ea_model.py@2320d52e reads pytorch_model.bin


def choices(recipe: Recipe) -> list[list[int]]:
    """The recipe's EAGLE tree (the chain of ``max_draft_len`` when unset)."""
    s = recipe.speculative
    return [list(c) for c in s.eagle_choices] if s.eagle_choices else chain(s.max_draft_len)


def tree_shape(tree: list[list[int]]) -> tuple[int, int]:
    """(num_eagle_layers: the tree's depth, max_non_leaves_per_layer: the most nodes with children on one level)."""
    parents = {tuple(c[:-1]) for c in tree if len(c) > 1} | ({()} if tree else set())
    per_level: dict[int, int] = {}
    for p in parents:
        per_level[len(p)] = per_level.get(len(p), 0) + 1
    return max(len(c) for c in tree), max(per_level.values(), default=1)


def triton_choices(recipe: Recipe) -> str:
    """Triton's ``eagle_choices`` parameter: ``{0}, {0, 0}`` ("" unless eagle)."""
    return braces(choices(recipe)) if recipe.speculative.decoding_type == "eagle" else ""


def dynamic(recipe: Recipe) -> bool:
    """EAGLE-3's dynamic tree (EAGLE-2)."""
    return recipe.speculative.decoding_type == "Eagle3" and recipe.speculative.use_dynamic_tree


def dynamic_knobs(recipe: Recipe) -> dict:
    """The twin executor's dynamic-tree fields ({} without one): max_draft_len its draft tokens."""
    s = recipe.speculative
    if not dynamic(recipe):
        return {}
    return {
        "max_draft_len": draft_len(recipe),
        "dynamic_tree_max_top_k": s.dynamic_tree_max_top_k or 0,
        "dynamic_tree_depth": s.max_draft_len,
    }


def twin_choices(recipe: Recipe) -> str:
    """The twin executor's ``eagle_choices`` (the same brace format): eagle's tree or chain, EAGLE-3's static tree
    ("" otherwise: EAGLE-3's chain is HiddenDrafter's)."""
    s = recipe.speculative
    if s.decoding_type == "Eagle3":
        return braces(choices(recipe)) if s.eagle_choices else ""
    return triton_choices(recipe)


def eagle_findings(recipe: Recipe, m: Optional[ModelDims], head_dir) -> Iterable[Finding]:
    s = recipe.speculative
    if s.decoding_type == "Eagle3":
        yield from eagle3_tree_findings(recipe)
        return
    if s.decoding_type != "eagle":
        for key in KEYS:
            if getattr(s, key) is not None:
                yield f"{KEY}.{key}", f"only decoding_type eagle (or Eagle3) takes {key}; remove it"
        if s.use_dynamic_tree:
            yield f"{KEY}.use_dynamic_tree", "only decoding_type eagle (or Eagle3) takes use_dynamic_tree; remove it"
        return
    if s.max_total_draft_tokens is not None:
        yield f"{KEY}.max_total_draft_tokens", "only Eagle3's dynamic tree takes max_total_draft_tokens; remove it"
    if s.use_dynamic_tree:
        if s.eagle_choices:
            yield f"{KEY}.use_dynamic_tree", "use_dynamic_tree and eagle_choices are mutually exclusive (upstream)"
        yield (
            f"{KEY}.use_dynamic_tree",
            "Triton's tensorrt_llm model builds EagleConfig(eagle_choices) alone (tensorrtllm_backend model.py@01200cc4):"
            " no parameter turns EAGLE-2's dynamic tree on, so trtpipe cannot write it; use eagle_choices",
        )
    elif s.dynamic_tree_max_top_k is not None:
        yield f"{KEY}.dynamic_tree_max_top_k", "dynamic_tree_max_top_k is read only with use_dynamic_tree: true"
    bad = list(_tree_findings(recipe, "trtllm-build --max_draft_len is the tree's size"))
    yield from bad
    if bad:
        return
    if m is not None and "llama" not in m.architecture.lower():
        yield (
            f"{KEY}.decoding_type",
            f"TensorRT-LLM's EagleForCausalLM extends LLaMAForCausalLM; {m.architecture} is not a Llama",
        )
    if recipe.parallel.pp > 1:
        yield "parallel.pp", f"EAGLE heads are converted at pp 1 only (pp {recipe.parallel.pp})"
    if head_dir is None:
        return
    yield from _head(Path(head_dir), m)


def _tree_findings(recipe: Recipe, why_size: str) -> Iterable[Finding]:
    """The tree as upstream's ``check_eagle_choices`` checks it (every prefix present), and ``max_draft_len`` its
    number of draft tokens."""
    s = recipe.speculative
    tree = choices(recipe)
    if any(not c or any(i < 0 for i in c) for c in tree):
        yield f"{KEY}.eagle_choices", "every choice is a non-empty path of top-k ranks (integers >= 0)"
        return
    loose = next((c for c in tree if len(c) > 1 and c[:-1] not in tree), None)
    if loose is not None:
        yield f"{KEY}.eagle_choices", f"choice {loose} is not connected: its prefix {loose[:-1]} is missing"
        return
    if len(tree) != s.max_draft_len:
        yield (
            f"{KEY}.max_draft_len",
            f"{s.max_draft_len} differs from the {len(tree)} draft tokens of eagle_choices ({why_size})",
        )


def eagle3_tree_findings(recipe: Recipe) -> Iterable[Finding]:
    """EAGLE-3's trees on the PyTorch backend (``decoding_type: Eagle3``, target llmapi), as upstream runs them (see
    the module docstring): the static tree in the two-model form; the dynamic tree refused (the twin does not run
    it)."""
    s = recipe.speculative
    if s.use_dynamic_tree:
        yield from eagle3_dynamic_tree_findings(recipe)
        return
    for key in ("dynamic_tree_max_top_k", "max_total_draft_tokens"):
        if getattr(s, key) is not None:
            yield f"{KEY}.{key}", f"{key} is read only with use_dynamic_tree: true (EAGLE-2's dynamic tree); remove it"
    if not s.eagle_choices:
        return
    if s.eagle3_one_model:
        yield (
            f"{KEY}.eagle_choices",
            "the one-model EAGLE-3 drafter never builds the static tree (upstream drafts eagle_choices in the "
            "two-model form only: tensorrt_llm/_torch/speculative/utils.py@3e906a0e); set eagle3_one_model: false",
        )
    if recipe.llmapi.version not in EAGLE3_TREE_RELEASES:
        yield (
            f"{KEY}.eagle_choices",
            f"llmapi.version {recipe.llmapi.version}: trtpipe writes EAGLE-3's eagle_choices for "
            f"{', '.join(sorted(EAGLE3_TREE_RELEASES))} only (the release that first ran the PyTorch backend's static "
            "tree is unconfirmed)",
        )
    yield from _tree_findings(recipe, "max_draft_len is the tree's draft tokens; the YAML writes its depth")


def eagle3_dynamic_tree_findings(recipe: Recipe) -> Iterable[Finding]:
    """EAGLE-2's dynamic tree as upstream runs it: one-model only (``get_spec_worker`` picks
    ``Eagle3OneModelDynamicTreeWorker`` for the one-model EAGLE-3, ``tensorrt_llm/_torch/speculative/utils.py``),
    ``dynamic_tree_max_topK`` children per expanded node, ``max_draft_len`` layers, ``max_total_draft_tokens`` kept
    out of the ``K + K*K*(max_draft_len - 1)`` nodes drafted (the history buffer of ``eagle3_dynamic_tree.py@470bb720``)."""
    s = recipe.speculative
    if s.eagle_choices:
        yield f"{KEY}.use_dynamic_tree", "use_dynamic_tree and eagle_choices are mutually exclusive (upstream)"
    if not s.eagle3_one_model:
        yield (
            f"{KEY}.use_dynamic_tree",
            "upstream drafts the dynamic tree in the one-model form only (Eagle3OneModelDynamicTreeWorker); "
            "set eagle3_one_model: true",
        )
    if recipe.llmapi.version not in EAGLE3_DYNAMIC_TREE_RELEASES:
        yield (
            f"{KEY}.use_dynamic_tree",
            f"llmapi.version {recipe.llmapi.version}: trtpipe writes EAGLE-3's dynamic tree for "
            f"{', '.join(sorted(EAGLE3_DYNAMIC_TREE_RELEASES))} only (the first release with "
            "Eagle3OneModelDynamicTreeWorker is unconfirmed)",
        )
    k, t = s.dynamic_tree_max_top_k, s.max_total_draft_tokens
    if k is None or k < 2:
        yield (
            f"{KEY}.dynamic_tree_max_top_k",
            f"{k}: the dynamic tree needs dynamic_tree_max_topK >= 2 (upstream's dynamic worker runs for K > 1; "
            "K = 1 is the chain of max_draft_len)",
        )
        return
    if t is None:
        yield f"{KEY}.max_total_draft_tokens", "the dynamic tree needs max_total_draft_tokens (its draft tokens)"
        return
    most = k + k * k * (s.max_draft_len - 1)
    if t > most:
        yield (
            f"{KEY}.max_total_draft_tokens",
            f"{t} exceeds the {most} nodes a dynamic tree of top-k {k} and depth {s.max_draft_len} drafts "
            "(K + K*K*(max_draft_len - 1))",
        )


def eagle3_tree_options(recipe: Recipe) -> dict:
    """The ``speculative_config`` keys of an EAGLE-3 static tree: ``eagle_choices`` and ``max_draft_len`` its depth
    (upstream's ``validate_eagle_config`` resets max_draft_len to the depth and counts ``max_total_draft_tokens``
    as the number of choices; writing the depth spares its warning). {} for the chain."""
    s = recipe.speculative
    if dynamic(recipe):  # EagleDecodingConfig's names; max_draft_len (the depth) is written as the recipe has it
        return {
            "speculative_config.use_dynamic_tree": True,
            "speculative_config.dynamic_tree_max_topK": s.dynamic_tree_max_top_k,
            "speculative_config.max_total_draft_tokens": s.max_total_draft_tokens,
        }
    if s.decoding_type != "Eagle3" or not s.eagle_choices:
        return {}
    tree = choices(recipe)
    return {
        "speculative_config.max_draft_len": max(len(c) for c in tree),
        "speculative_config.eagle_choices": tree,
    }


def _head(d: Path, m: Optional[ModelDims]) -> Iterable[Finding]:
    key = f"{KEY}.speculative_model"
    if not (d / "config.json").is_file():
        yield key, f"EAGLE head: {d / 'config.json'} not found"
        return
    if not any((d / f).is_file() for f in HEAD_FILES):
        yield key, f"EAGLE head: no {' or '.join(HEAD_FILES)} in {d}"
        return
    try:
        cfg = load_json(d / "config.json", CheckpointError)
    except CheckpointError as exc:
        yield key, f"EAGLE head: {exc}"
        return
    if m is None:
        return
    if int(cfg.get("hidden_size") or 0) != m.hidden_size:
        yield key, f"EAGLE head: hidden_size {cfg.get('hidden_size')} differs from the target's {m.hidden_size}"
    if int(cfg.get("vocab_size") or 0) != m.vocab_size:
        yield key, f"EAGLE head: vocab_size {cfg.get('vocab_size')} differs from the target's {m.vocab_size}"
