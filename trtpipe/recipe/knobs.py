"""The executor knobs a recipe decides, named as the fields of ``trtpipe.serving.api.ExecutorConfig``.

One table for every front end: :func:`trtpipe.serving.config.from_recipe` (the OpenAI twin, the Dynamo workers)
passes them to the one executor-config constructor, an HF directory served without a recipe gets the schema's
defaults (:func:`default_knobs`), and the Triton repository writer carries the ones no upstream parameter names in
the twin's ``executor_extras`` parameter (one JSON object). It lives beside the schema, below both, so the
repository writer need not import the serving layer (and the serving processes import it only when they start from
a recipe or its defaults: the Triton twin's stubs never load pydantic).
"""

from __future__ import annotations

import json
from typing import Any

from trtpipe.recipe.lookahead import recipe_config
from trtpipe.recipe.schema import KVCacheSection, Recipe, ServingSection, TritonSection

DEFAULT_QUEUE_PER_SLOT = 8  # serving.max_queue_size -1 (its default): this many waiting per batch slot

# Knobs that keep their upstream carrier in the Triton twin's config.pbtxt: the tensorrtllm backend's parameters
# (batch_scheduler_policy, enable_chunked_context, enable_kv_cache_reuse, guided_decoding_backend) and Triton's
# dynamic_batching queue.
UPSTREAM_KNOBS = frozenset(
    {
        "capacity_policy",
        "enable_chunked_context",
        "enable_kv_cache_reuse",
        "max_queue_size",
        "guided_decoding_backend",
        "medusa_choices",  # Triton's medusa_choices parameter (trtpipe.triton.repo)
    }
)


def knobs(max_batch_size: int, kv: KVCacheSection, triton: TritonSection, serving: ServingSection) -> dict[str, Any]:
    """The executor knobs (not the engine limits) of these recipe sections, by ExecutorConfig field.

    ``max_queue_size`` is the OpenAI twin's bound (``serving.max_queue_size``, -1: 8 per batch slot); the Triton
    twin's is Triton's own ``dynamic_batching`` queue (``triton.max_queue_size``)."""
    queue = serving.max_queue_size
    return {
        "capacity_policy": triton.scheduler_policy,
        "enable_kv_cache_reuse": kv.enable_reuse,
        "max_queue_size": DEFAULT_QUEUE_PER_SLOT * max_batch_size if queue < 0 else queue,
        "request_timeout_s": serving.request_timeout_s,
        "guided_decoding_backend": serving.guided_decoding_backend,
    }


def speculative_knobs(recipe: Recipe) -> dict[str, Any]:
    """What the twin executes of ``speculative:`` (NGram, DraftTarget and the engine's draft_tokens_external, MTP
    with the target's MTP layer, Eagle3 with its head, the engine's medusa with its heads (chain-shaped choices,
    or a tree of choices), the engine's lookahead_decoding with its (W, N, G), the engine's eagle with its EAGLE-1/2
    head (eagle_choices: a chain or a static tree), Eagle3's static tree (eagle_choices, two-model); a draft or head as
    a local directory)."""
    from trtpipe.recipe.eagle import dynamic_knobs, twin_choices as eagle_choices
    from trtpipe.recipe.medusa import choices
    from trtpipe.recipe.speculative import TWIN_EXECUTES, draft_dir

    s = recipe.speculative
    if s.decoding_type not in TWIN_EXECUTES:
        return {}
    la = recipe_config(recipe)
    if la is not None:  # lookahead_decoding: (W, N, G) and the draft length that follows
        return {"speculative_decoding_type": TWIN_EXECUTES[s.decoding_type], **la.executor_fields()}
    draft = draft_dir(recipe)
    return {
        "speculative_decoding_type": TWIN_EXECUTES[s.decoding_type],
        "max_draft_len": s.max_draft_len,
        "max_matching_ngram_size": s.max_matching_ngram_size,
        "speculative_model": str(draft) if draft is not None else "",
        **({"medusa_choices": choices(recipe)} if s.decoding_type == "medusa" and s.medusa_choices else {}),
        **({"eagle_choices": eagle_choices(recipe)} if s.decoding_type in ("eagle", "Eagle3") else {}),
        **dynamic_knobs(recipe),  # EAGLE-3's dynamic tree: max_draft_len its draft tokens
    }


def executor_knobs(recipe: Recipe) -> dict[str, Any]:
    """:func:`knobs` of the recipe, its speculative decoding, and ``max_loras`` (adapters one step may hold) when
    it serves LoRA adapters."""
    lora = {"max_loras": recipe.lora.max_loras} if recipe.lora.adapters else {}
    return {
        **knobs(recipe.engine.max_batch_size, recipe.engine.kv_cache, recipe.triton, recipe.serving),
        **speculative_knobs(recipe),
        **lora,
    }


def default_knobs(max_batch_size: int) -> dict[str, Any]:
    """The knobs of a recipe that sets none (an HF directory served as it is)."""
    return knobs(max_batch_size, KVCacheSection(), TritonSection(), ServingSection())


def twin_extras(recipe: Recipe, speculation: bool = True) -> str:
    """The Triton twin's ``executor_extras`` parameter: the knobs of :func:`executor_knobs` no upstream parameter
    carries. ``speculation`` False: without the speculative knobs (a model of the two-model draft-target form,
    whose drafts the BLS brings as ``draft_input_ids``)."""
    # lookahead: carried by the tensorrt_llm model's own decoding_mode and lookahead_* parameters
    spec = () if speculation and recipe_config(recipe) is None else tuple(speculative_knobs(recipe))
    return json.dumps(
        {k: v for k, v in executor_knobs(recipe).items() if k not in UPSTREAM_KNOBS and k not in spec}, sort_keys=True
    )
