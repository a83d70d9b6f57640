"""What speculative decoding adds to a GPU's memory plan: the draft's weights and KV, and longer sequences.

Counted per GPU for the recipe's ``speculative:`` section (``trtpipe/recipe/speculative.py``):
- **weights**: a draft model or EAGLE/Medusa head given as ``speculative_model``: its safetensors bytes as stored
  (a config-only directory has none: then 0, and the plan says the draft weights were not counted; an EAGLE-3
  head's are computed from its config.json, and an EAGLE-1/2 head's as the engine's EagleNets hold it, one copy per
  eagle layer: :mod:`trtpipe.engine.draft_heads`), split over the
  target's tensor-parallel ranks and held on every pipeline rank (upper bound); n-gram / lookahead drafts have no
  weights; MTP layers ship inside the target checkpoint, whose weights the plan already counts;
- **KV per token**: 2 x the draft config's layers x ceil(kv heads / tp) x head size x the target's KV bytes, added to
  the target's per-token KV (the draft caches every token the target does); MTP: the target's own per-layer KV x the
  layers TensorRT-LLM adds to its KV cache manager for them (``get_num_spec_layers``,
  ``tensorrt_llm/_torch/speculative/utils.py@011d0933``: 1 for MTP-Eagle, a checkpoint of one MTP layer;
  ``num_nextn_predict_layers`` for vanilla MTP), the layers the twin's pool holds too
  (:mod:`trtpipe.serving.hidden_draft`);
- **sequence length**: each sequence may hold ``max_draft_len`` positions beyond max_seq_len while it verifies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.engine.draft_heads import eagle1_engine_bytes, eagle3_head_bytes, is_eagle3_head
from trtpipe.errors import TrtpipeError
from trtpipe.jsonfile import load_json
from trtpipe.recipe.lookahead import draft_len
from trtpipe.recipe.schema import Recipe

NO_DRAFT_WEIGHTS = frozenset({"none", "NGram", "lookahead_decoding", "MTP"})


@dataclass(frozen=True)
class DraftMemory:
    weight_bytes: int  # per GPU
    kv_bytes_per_token: float  # per GPU
    extra_positions: int
    counted_from: str  # "files", "none" (no draft weights), or why the weights could not be counted


def _config(path: Path) -> dict:
    try:
        return load_json(path / "config.json")
    except (OSError, ValueError, TrtpipeError):  # unreadable: the plan says the weights could not be counted
        return {}


def mtp_kv_layers(recipe: Recipe) -> int:
    """KV layers of the target's MTP layers in the pool: 1 (MTP-Eagle) or ``num_nextn_predict_layers`` (vanilla)."""
    from trtpipe.recipe.rules import model_dir

    try:
        layers = int(_config(model_dir(recipe)).get("num_nextn_predict_layers") or 0)
    except (OSError, TrtpipeError):  # an unreadable model: validation says so; nothing counted here
        return 0
    return 1 if layers == 1 else layers


def draft_memory(recipe: Recipe, tp: int, kv_bytes: float, layer_kv: float = 0.0) -> Optional[DraftMemory]:
    """The draft's share of each GPU (None without speculation); ``kv_bytes``: bytes of one KV element;
    ``layer_kv``: the target's KV bytes per token of one layer on one GPU (what an MTP layer caches)."""
    s = recipe.speculative
    if not s.enabled:
        return None
    if s.decoding_type == "MTP":  # weights inside the target checkpoint (counted); KV in the target's pool
        return DraftMemory(0, mtp_kv_layers(recipe) * layer_kv, s.max_draft_len, "none")
    if s.decoding_type in NO_DRAFT_WEIGHTS or s.speculative_model is None:  # lookahead: D from (W, N, G)
        return DraftMemory(0, 0.0, draft_len(recipe), "none")
    from trtpipe.recipe.speculative import draft_dir

    try:
        path = draft_dir(recipe)
    except Exception as exc:  # noqa: BLE001 - a hub draft not in the cache: the plan says so, it does not fail
        return DraftMemory(0, 0.0, draft_len(recipe), f"not counted ({type(exc).__name__})")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    weights = sum(f.stat().st_size for f in files)
    cfg = _config(path)
    heads = int(cfg.get("num_attention_heads") or 0)
    head = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    per_tok = 2 * int(cfg.get("num_hidden_layers") or 0) * math.ceil(kv_heads / tp) * head * kv_bytes
    how = "files" if files else "not counted (no *.safetensors in the draft directory)"
    if s.decoding_type == "eagle" and recipe.target == "engine":  # the EagleNets the engine holds (draft_heads.py)
        from trtpipe.recipe.eagle import choices, tree_shape

        try:
            layers = tree_shape(choices(recipe))[0]
            weights, how = eagle1_engine_bytes(cfg, layers), f"EAGLE head x {layers} EagleNets from its config.json"
        except (KeyError, ValueError) as key:  # validation names the head's problems
            weights, how = 0, f"not counted (the head's config.json lacks {key})"
    elif not files and is_eagle3_head(cfg):  # a published head's config.json alone (trtpipe/engine/draft_heads.py)
        try:
            weights, how = eagle3_head_bytes(cfg), "EAGLE-3 head computed from its config.json"
        except KeyError as key:  # validation names the head's problems; the plan says what it could not count
            how = f"not counted (the head's config.json has no {key})"
    return DraftMemory(weights // tp, per_tok, draft_len(recipe), how)  # a dynamic tree: its draft tokens
