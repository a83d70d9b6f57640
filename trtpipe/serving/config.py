"""The one place an :class:`~trtpipe.serving.api.ExecutorConfig` is made, and its one serialized form.

Every front end runs the same executor (the Triton twin, the OpenAI twin, the Dynamo worker, the simulator), so each
gets its configuration from :func:`executor_config`, from a recipe through :func:`from_recipe`, and across a process
boundary through :func:`to_json` / :func:`from_json`. Two rules decide what used to drift between them:

- **KV pool.** ``num_blocks = ceil(kv_tokens / tokens_per_block)``, as TensorRT-LLM sizes its primary pool
  (``blocksInPrimaryPool = tc::ceilDiv(maxTokens, tokensPerBlock)``,
  ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp@b35ac1b6``). ``kv_tokens`` is the recipe's
  ``engine.kv_cache.max_tokens`` (Triton: ``max_tokens_in_paged_kv_cache``; the simulator: the memory planner's
  pool), else one max-length sequence per batch slot (on a GPU the pool is what free memory allows; on the CPU twin
  that would be host memory the model does not need). Never fewer blocks than one max-length sequence needs, so an
  admitted request can always finish.
- **KV reuse** is on unless the recipe turns it off: ``KvCacheConfig.enable_block_reuse`` defaults to True
  (``tensorrt_llm/llmapi/llm_args.py@fcd3f316``), and so does the ``tensorrtllm`` backend's
  ``enable_kv_cache_reuse`` since 1.x (docs/reference/trtllm-build.md).

A new executor knob is a field of ``ExecutorConfig`` (and what the executor does with it), a recipe key and one line
of :func:`trtpipe.recipe.knobs.knobs`: this constructor, the serialized form, the Triton twin's ``executor_extras``
parameter, the OpenAI twin's defaults and every front end follow from those.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from typing import Any, Optional

from trtpipe.serving.api import CapacityPolicy, ExecutorConfig

KV_REUSE_DEFAULT = True  # KvCacheConfig.enable_block_reuse (llm_args.py@fcd3f316)
TWIN_MAX_BATCH_SIZE = 8  # an HF directory has no engine section: the OpenAI twin's batch
TWIN_TOKENS_PER_BLOCK = 32  # ... and block size (TensorRT-LLM's default tokens_per_block)


def kv_blocks(kv_tokens: Optional[int], tokens_per_block: int, max_batch_size: int, max_seq_len: int) -> int:
    """Blocks of the KV pool: ceil(tokens / tokens_per_block) (kvCacheManager.cpp@b35ac1b6), tokens defaulting
    to one max-length sequence per batch slot, never fewer than one max-length sequence needs."""
    tokens = kv_tokens if kv_tokens is not None else max_batch_size * max_seq_len
    return max(math.ceil(tokens / tokens_per_block), math.ceil(max_seq_len / tokens_per_block))


def executor_config(
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_input_len: int,
    max_seq_len: int,
    tokens_per_block: int,
    kv_tokens: Optional[int] = None,
    **knobs: Any,
) -> ExecutorConfig:
    """The executor configuration of an engine's limits and a front end's knobs (any other ExecutorConfig field:
    ``capacity_policy`` by value or name, ``enable_kv_cache_reuse`` defaulting to :data:`KV_REUSE_DEFAULT`, ...)."""
    knobs = {"enable_kv_cache_reuse": KV_REUSE_DEFAULT, **knobs}
    if "capacity_policy" in knobs:
        knobs["capacity_policy"] = CapacityPolicy(knobs["capacity_policy"])
    return ExecutorConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        num_blocks=kv_blocks(kv_tokens, tokens_per_block, max_batch_size, max_seq_len),
        tokens_per_block=tokens_per_block,
        **knobs,
    )


def from_recipe(recipe, model_max_seq_len: int) -> ExecutorConfig:
    """What trtllm-serve would run for a recipe: its engine limits (the sequence capped by the model's
    ``max_position_embeddings``), its KV pool (``engine.kv_cache``) and :func:`trtpipe.recipe.knobs.executor_knobs`."""
    from trtpipe.recipe.knobs import executor_knobs  # here: a serving process that starts from a config never loads it

    e, kv = recipe.engine, recipe.engine.kv_cache
    seq = min(e.max_seq_len or model_max_seq_len, model_max_seq_len)
    return executor_config(
        max_batch_size=e.max_batch_size,
        max_num_tokens=e.max_num_tokens,
        max_input_len=min(e.max_input_len, seq - 1),
        max_seq_len=seq,
        kv_tokens=kv.max_tokens,
        tokens_per_block=kv.tokens_per_block,
        **executor_knobs(recipe),
    )


def twin_default(
    max_seq_len: int, max_batch_size: int = TWIN_MAX_BATCH_SIZE, tokens_per_block: int = TWIN_TOKENS_PER_BLOCK
) -> ExecutorConfig:
    """The OpenAI twin of a bare HF directory (no recipe): the recipe schema's default knobs for its model's length."""
    from trtpipe.recipe.knobs import default_knobs

    return executor_config(
        max_batch_size=max_batch_size,
        max_num_tokens=max(2048, max_seq_len),
        max_input_len=max_seq_len - 1,
        max_seq_len=max_seq_len,
        tokens_per_block=tokens_per_block,
        **default_knobs(max_batch_size),
    )


# --- the one serialized form -----------------------------------------------------------------------------------


def to_dict(config: ExecutorConfig) -> dict[str, Any]:
    """Plain JSON data: every field, the policy by its name."""
    return {**asdict(config), "capacity_policy": CapacityPolicy(config.capacity_policy).value}


def from_dict(data: dict[str, Any]) -> ExecutorConfig:
    """The inverse of :func:`to_dict`; a field it does not know is an error (a newer writer), a missing one takes
    its default (an older writer)."""
    known = {f.name for f in fields(ExecutorConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"executor config: unknown field(s) {', '.join(unknown)}")
    policy = CapacityPolicy(data.get("capacity_policy", CapacityPolicy.GUARANTEED_NO_EVICT))
    return ExecutorConfig(**{**data, "capacity_policy": policy})


def to_json(config: ExecutorConfig) -> str:
    return json.dumps(to_dict(config), sort_keys=True)


def from_json(text: str) -> ExecutorConfig:
    return from_dict(json.loads(text))


def replace_knobs(config: ExecutorConfig, **knobs) -> ExecutorConfig:
    """``config`` with some knobs changed (through the serialized form, so it stays the one way in)."""
    return from_dict({**to_dict(config), **knobs})


# --- the Triton twin's extras parameter ------------------------------------------------------------------------


def read_twin_extras(text: Optional[str]) -> dict[str, Any]:
    """``executor_extras`` back to keyword arguments of :func:`executor_config` (unset: none)."""
    extras = json.loads(text) if text else {}
    unknown = sorted(set(extras) - {f.name for f in fields(ExecutorConfig)})
    if unknown:
        raise ValueError(f"executor extras: unknown field(s) {', '.join(unknown)}")
    return extras
