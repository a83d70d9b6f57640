"""Speculative decoding in a recipe: the rules that check it and the ``speculative_config`` it becomes.

Names are TensorRT-LLM's. llmapi (PyTorch backend): ``speculative_config`` with ``decoding_type`` NGram,
DraftTarget, Eagle3 or MTP, ``max_draft_len``, ``speculative_model``, ``max_matching_ngram_size``,
``eagle3_one_model`` (``tensorrt_llm/llmapi/llm_args.py@fcd3f316``: ``DecodingBaseConfig.from_dict`` dispatches on
"MTP", "Medusa", "Eagle", "Lookahead", "NGram", "DraftTarget"; ``Eagle3DecodingConfig`` with
``decoding_type: Literal["Eagle3"]`` is in a later revision whose commit the code index does not record; a 1.0/1.1-era
revision spells the draft ``speculative_model_dir``, which is what is written for llmapi.version 1.0 and 1.1:
**which release renamed it is unconfirmed**). Engine (trtllm-build): ``--speculative_decoding_mode`` with
draft_tokens_external, lookahead_decoding, medusa or eagle and ``--max_draft_len``
(``tensorrt_llm/commands/build.py@65f1d153``).

Combinations are checked against the PyTorch backend's feature-combination matrix
(``docs/source/torch/features/feature_combination_matrix.md@116f6ea9``): EAGLE-3 two-model × KV cache reuse = No,
EAGLE-3 two-model × overlap scheduler = No (the YAML turns the overlap scheduler off), MTP needs a model with MTP
layers (``num_nextn_predict_layers``) on SM >= 90. A draft model must be a family trtpipe converts and have the
target's tokenizer (compared file by file: tokenizer.json, else tokenizer.model).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.lookahead import LLMAPI_TYPE as LLMAPI_LOOKAHEAD, draft_len, lookahead_findings
from trtpipe.recipe.rules import Finding, model_dir
from trtpipe.recipe.schema import ENGINE_DECODING_TYPES, LLMAPI_DECODING_TYPES, Recipe

KEY = "speculative"
NEEDS_MODEL = frozenset({"DraftTarget", "Eagle3", "draft_tokens_external", "medusa", "eagle"})
# what the CPU twin runs (trtpipe/serving/speculative.py), by recipe spelling: the engine path's external draft
# tokens are draft-target decoding with a second model (tensorrtllm_backend's two-model BLS)
TWIN_EXECUTES = {
    "NGram": "NGram",
    "DraftTarget": "DraftTarget",
    "draft_tokens_external": "DraftTarget",
    "MTP": "MTP",  # the target checkpoint's MTP layer (trtpipe/serving/hidden_draft.py)
    "Eagle3": "Eagle3",  # an EAGLE-3 head over the target's hidden states (same module)
    "medusa": "Medusa",  # Medusa heads, medusa_choices a chain or a tree (trtpipe/serving/medusa.py)
    "lookahead_decoding": "Lookahead",  # the window, pool and verification set (trtpipe/serving/lookahead.py)
    "eagle": "Eagle",  # an EAGLE-1/2 head, eagle_choices a chain or a static tree (trtpipe/serving/eagle1.py)
}
EAGLE3_MIN_LAYERS = 6  # _get_eagle3_default_capture_layers needs more than 5 (eagle3.py@f933a608)
MTP_MIN_SM = 90
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def check_mtp_draft_len(layers: int, max_draft_len: int) -> Optional[str]:
    """Why ``max_draft_len`` does not run on a checkpoint of ``layers`` MTP layers, or None.

    TensorRT-LLM runs vanilla MTP (one layer per draft) whenever the checkpoint has more than one MTP layer, and then
    drafts min(max_draft_len, layers) tokens: a larger max_draft_len is cut with only a warning
    (``update_spec_config_from_model_config``, ``tensorrt_llm/_torch/speculative/utils.py@011d0933``). trtpipe refuses
    it rather than write a draft length that does not run. One layer (MTP-Eagle) reuses it for any draft length."""
    if layers > 1 and max_draft_len > layers:
        return (
            f"{max_draft_len} drafts need {max_draft_len} MTP layers: the checkpoint has num_nextn_predict_layers "
            f"{layers}, and TensorRT-LLM's vanilla MTP drafts one token per layer (it would cut max_draft_len to "
            f"{layers}); set max_draft_len <= {layers}"
        )
    return None


def draft_dir(recipe: Recipe) -> Optional[Path]:
    """The local directory of ``speculative.speculative_model`` (hf:// through the hub cache), or None."""
    src = recipe.speculative.speculative_model
    if src is None:
        return None
    if src.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        return resolve_hf(src)
    return recipe.resolve(src)


def _raw_config(path: Path) -> dict:
    try:
        return load_json(path / "config.json", CheckpointError)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {exc}") from None


def _digest(path: Path) -> Optional[tuple[str, str]]:
    for name in TOKENIZER_FILES:
        if (path / name).is_file():
            return name, hashlib.sha256((path / name).read_bytes()).hexdigest()
    return None


def _spelling(recipe: Recipe) -> Iterable[Finding]:
    s = recipe.speculative
    if recipe.target == "llmapi" and s.decoding_type in ENGINE_DECODING_TYPES:
        yield (
            f"{KEY}.decoding_type",
            (f"{s.decoding_type} is a trtllm-build mode; target llmapi takes {', '.join(LLMAPI_DECODING_TYPES)}"),
        )
    if recipe.target == "engine" and s.decoding_type in LLMAPI_DECODING_TYPES:
        yield (
            f"{KEY}.decoding_type",
            (
                f"{s.decoding_type} is a PyTorch-backend speculative_config type; target engine takes "
                f"{', '.join(ENGINE_DECODING_TYPES)} (or set target: llmapi)"
            ),
        )
    if s.decoding_type not in ("none", LLMAPI_LOOKAHEAD) and s.decoding_type not in TWIN_EXECUTES:
        # trtpipe writes only what its CPU twin executes (so every generated setting is tested)
        yield (
            f"{KEY}.decoding_type",
            f"{s.decoding_type} is not executed by trtpipe's CPU twin yet, so trtpipe does not write it "
            f"(executed: {', '.join(sorted(TWIN_EXECUTES))})",
        )
    if s.decoding_type in NEEDS_MODEL and s.speculative_model is None:
        yield f"{KEY}.speculative_model", f"decoding_type {s.decoding_type} needs a draft model or head: set it"
    if s.decoding_type not in NEEDS_MODEL and s.speculative_model is not None:
        yield f"{KEY}.speculative_model", f"decoding_type {s.decoding_type} takes no draft model; remove it"


def _matrix(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    s = recipe.speculative
    if s.decoding_type == "Eagle3" and not s.eagle3_one_model and recipe.engine.kv_cache.enable_reuse:
        yield (
            f"{KEY}.eagle3_one_model",
            (
                "EAGLE-3 two-model does not run with KV cache reuse (feature-combination matrix: No); set "
                "eagle3_one_model: true or engine.kv_cache.enable_reuse: false"
            ),
        )
    if s.decoding_type == "MTP":
        from trtpipe.formats.gpus import get_gpu

        sm = get_gpu(recipe.engine.gpu).sm
        if sm < MTP_MIN_SM:
            yield f"{KEY}.decoding_type", f"MTP needs SM >= {MTP_MIN_SM}; engine.gpu {recipe.engine.gpu} is SM {sm}"
        if m is not None:
            layers = int(_raw_config(model_dir(recipe)).get("num_nextn_predict_layers") or 0)
            if layers < 1:
                yield (
                    f"{KEY}.decoding_type",
                    (
                        f"MTP needs a model with MTP layers; {m.architecture} has num_nextn_predict_layers "
                        f"{layers} (use NGram, DraftTarget or Eagle3)"
                    ),
                )
            elif why := check_mtp_draft_len(layers, s.max_draft_len):
                yield f"{KEY}.max_draft_len", why
    k = draft_len(recipe)  # lookahead's follows from (W, N, G)
    need = recipe.engine.max_batch_size * (k + 1)
    if recipe.engine.max_num_tokens < need:
        yield (
            "engine.max_num_tokens",
            (
                f"{recipe.engine.max_num_tokens} tokens per step cannot verify a full batch: max_batch_size "
                f"{recipe.engine.max_batch_size} x (max_draft_len {k} + 1) = {need}; raise it or lower "
                "max_batch_size"
            ),
        )


def _draft_model(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """A draft model (not an EAGLE/Medusa head): readable, a family trtpipe converts, the target's tokenizer."""
    s = recipe.speculative
    if s.decoding_type not in ("DraftTarget", "draft_tokens_external") or s.speculative_model is None or m is None:
        return
    from trtpipe.models import get_family
    from trtpipe.models.dims import read_hf_config

    key = f"{KEY}.speculative_model"
    try:
        path = draft_dir(recipe)
        if not path.is_dir():
            yield key, f"draft model directory not found: {path}"
            return
        draft = read_hf_config(path)
        get_family(draft.architecture)
    except CheckpointError as exc:
        yield key, f"draft model: {exc}"
        return
    if draft.vocab_size != m.vocab_size:
        yield key, f"draft vocab_size {draft.vocab_size} differs from the target's {m.vocab_size}"
        return
    mine, theirs = _digest(model_dir(recipe)), _digest(path)
    if mine is None or theirs is None:
        yield key, f"cannot compare tokenizers: no {' or '.join(TOKENIZER_FILES)} in both model directories"
    elif mine != theirs:
        yield key, f"draft tokenizer ({theirs[0]}) differs from the target's: drafts must share the target's tokenizer"


def _eagle3_head(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    """An EAGLE-3 head (``LlamaForCausalLMEagle3``-style config.json): the target's width and vocabulary, a target deep
    enough for upstream's default capture layers (1, L/2 - 1, L - 4)."""
    s = recipe.speculative
    if s.decoding_type != "Eagle3" or s.speculative_model is None or m is None:
        return
    key = f"{KEY}.speculative_model"
    try:
        path = draft_dir(recipe)
        if not (path / "config.json").is_file():
            yield key, f"EAGLE-3 head: {path / 'config.json'} not found"
            return
        cfg = _raw_config(path)
    except CheckpointError as exc:
        yield key, f"EAGLE-3 head: {exc}"
        return
    width = int(cfg.get("target_hidden_size") or cfg.get("hidden_size") or 0)
    if width != m.hidden_size:
        yield key, f"EAGLE-3 head: hidden_size {width} differs from the target's {m.hidden_size}"
    if int(cfg.get("vocab_size") or 0) != m.vocab_size:
        yield key, f"EAGLE-3 head: vocab_size {cfg.get('vocab_size')} differs from the target's {m.vocab_size}"
    if m.num_layers < EAGLE3_MIN_LAYERS:
        yield (
            f"{KEY}.decoding_type",
            (
                f"EAGLE-3 captures target layers (1, L/2 - 1, L - 4): {m.architecture} has {m.num_layers} layers, "
                f"needs >= {EAGLE3_MIN_LAYERS}"
            ),
        )


def longest_acceptance(recipe: Recipe) -> tuple[int, str]:
    """The most tokens one target forward can yield (accepted drafts + the target's own) and what bounds it: a tree
    (Medusa's medusa_choices, EAGLE's eagle_choices) accepts one path, its depth; lookahead accepts at most N - 1
    tokens of one n-gram; a chain accepts all max_draft_len."""
    s = recipe.speculative
    if s.decoding_type == "lookahead_decoding":
        return s.max_ngram_size, "max_ngram_size"
    tree = None
    if s.decoding_type == "medusa" and s.medusa_choices:
        tree, key = s.medusa_choices, "medusa_choices"
    elif s.decoding_type in ("eagle", "Eagle3") and s.eagle_choices:
        tree, key = s.eagle_choices, "eagle_choices"
    if tree:
        return max(len(c) for c in tree) + 1, f"the depth of {key} + 1"
    return s.max_draft_len + 1, "max_draft_len + 1"


def _acceptance(recipe: Recipe) -> Iterable[Finding]:
    """``acceptance_length`` (trtpipe's key): accepted drafts + 1 per verification, so within [1, the longest
    accepted path + 1]."""
    s = recipe.speculative
    if s.acceptance_length is None:
        return
    if not s.enabled:
        yield f"{KEY}.acceptance_length", "set without speculative decoding (decoding_type none): remove it"
        return
    top, what = longest_acceptance(recipe)
    if not 1 <= s.acceptance_length <= top:
        yield (
            f"{KEY}.acceptance_length",
            f"{s.acceptance_length:g} is outside [1, {what} = {top}]: it counts the accepted drafts plus the "
            "target's own token per target forward",
        )


def _speculative(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    yield from _acceptance(recipe)
    if not recipe.speculative.enabled:
        return
    yield from _spelling(recipe)
    yield from _matrix(recipe, m)
    yield from _draft_model(recipe, m)
    yield from _eagle3_head(recipe, m)
    yield from _engine_heads(recipe, m)
    yield from lookahead_findings(recipe)


# engine-target heads built into the engine: decoding_type -> (what the errors call them, the module and function
# ``(recipe, dims, head_dir)`` that checks them; imported when used: they import this module)
ENGINE_HEADS = {
    "medusa": ("Medusa heads", "trtpipe.recipe.medusa", "medusa_findings"),
    "eagle": ("EAGLE head", "trtpipe.recipe.eagle", "eagle_findings"),
}


def _engine_heads(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    import importlib

    s = recipe.speculative
    for kind, (what, module, check) in ENGINE_HEADS.items():
        head = None
        if s.decoding_type == kind and s.speculative_model is not None:
            try:
                head = draft_dir(recipe)
            except CheckpointError as exc:
                yield f"{KEY}.speculative_model", f"{what}: {exc}"
                continue
        yield from getattr(importlib.import_module(module), check)(recipe, m, head)


SPECULATIVE_RULES = (_speculative,)


def draft_reference(recipe: Recipe) -> Optional[str]:
    """``speculative_model`` as trtllm-serve reads it: a hub id (``org/name``) or the absolute local path."""
    src = recipe.speculative.speculative_model
    if src is None:
        return None
    return src[len("hf://") :].split("@")[0] if src.startswith("hf://") else str(recipe.resolve(src))


def speculative_config(recipe: Recipe, version: str) -> dict[str, Any]:
    """The dotted ``speculative_config.*`` keys of the extra_llm_api_options YAML ({} when speculation is off)."""
    s = recipe.speculative
    if not s.enabled or recipe.target != "llmapi":
        return {}
    model_key = "speculative_model_dir" if version in ("1.0", "1.1") else "speculative_model"
    out: dict[str, Any] = {
        "speculative_config.decoding_type": s.decoding_type,
        "speculative_config.max_draft_len": s.max_draft_len,
        f"speculative_config.{model_key}": draft_reference(recipe),
    }
    if s.decoding_type == "NGram":
        out["speculative_config.max_matching_ngram_size"] = s.max_matching_ngram_size
    if s.decoding_type == "Eagle3":
        out["speculative_config.eagle3_one_model"] = s.eagle3_one_model
        from trtpipe.recipe.eagle import eagle3_tree_options

        out.update(eagle3_tree_options(recipe))  # a static tree: eagle_choices, max_draft_len its depth
        if not s.eagle3_one_model:
            out["disable_overlap_scheduler"] = True  # matrix: EAGLE-3 two-model x overlap scheduler = No
    if s.decoding_type == "MTP":
        out["speculative_config.num_nextn_predict_layers"] = s.max_draft_len
    return out
