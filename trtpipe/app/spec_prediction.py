"""``trtpipe predict --acceptance-length``: the recipe's speculative decoding in the prediction.

The recipe's ``speculative:`` section gives the kind and k (``max_draft_len``); the drafter's deployment follows it
(:func:`trtpipe.perf.speculative.draft_deployment`): n-gram / lookahead drafts cost nothing, an EAGLE-3 / EAGLE
head is one target-shaped layer in 16 bits over the head's draft vocabulary (``draft_vocab_size`` of its
config.json when the head directory is readable), an MTP module one target layer at the target's precision, a
draft model its own config at the target's precision. Medusa's heads have no draft forwards: they run inside the
verification (:func:`trtpipe.perf.speculative.medusa_terms`; ``num_medusa_heads`` or the heads' ``medusa_num_heads``,
their ``medusa_num_layers``). The plain prediction (the simulator) stays as it is; the
speculative block scales its decode part by the step model's speed-up.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from trtpipe.errors import TrtpipeError
from trtpipe.jsonfile import load_json
from trtpipe.perf.cost import Constants, Deployment
from trtpipe.perf.models import spec_of
from trtpipe.perf.speculative import HEAD_DRAFTS, IN_VERIFY_HEADS, draft_deployment, speculative_step

HEAD_PRECISION = "bf16"  # published EAGLE-3 heads ship in BF16 (e.g. yuhuili/EAGLE3-LLaMA3.3-Instruct-70B)


def _draft_config(recipe) -> Optional[dict]:
    from trtpipe.recipe.speculative import draft_dir

    try:
        path = draft_dir(recipe)
        return load_json(path / "config.json") if path is not None else None
    except (OSError, ValueError, TrtpipeError):
        return None


def drafter(recipe, target: Deployment) -> Optional[Deployment]:
    """The deployment whose k forwards draft each step (None: n-gram / lookahead)."""
    s = recipe.speculative
    cfg = _draft_config(recipe)
    if s.decoding_type in HEAD_DRAFTS:
        vocab = int(cfg.get("draft_vocab_size") or 0) if cfg else 0
        d = draft_deployment(target, s.decoding_type, draft_vocab=vocab or None)
        return d if s.decoding_type == "MTP" else replace(d, precision=HEAD_PRECISION)
    if s.decoding_type in ("DraftTarget", "draft_tokens_external"):
        if cfg is None:
            raise TrtpipeError(
                f"speculative.speculative_model: cannot read the draft model's config.json ({s.speculative_model}); "
                "its forwards cannot be costed"
            )
        return draft_deployment(target, s.decoding_type, draft_model=spec_of(cfg, "draft"))
    return draft_deployment(target, s.decoding_type)


def recipe_acceptance_length(recipe_path: Path, overrides: Iterable[str], flag: Optional[float]) -> Optional[float]:
    """The acceptance length a prediction uses: the ``--acceptance-length`` flag, else the recipe's
    ``speculative.acceptance_length`` (trtpipe's own key), else None (no speculative prediction)."""
    if flag is not None:
        return flag
    from trtpipe.app.validation import load_recipe

    return load_recipe(recipe_path, list(overrides), check_rules=False).speculative.acceptance_length


def plan_block(
    recipe_path: Path, overrides: Iterable[str], gpu, model_config, isl: int, osl: int, acceptance_length: float
) -> dict:
    """What ``trtpipe plan`` adds for an acceptance length: the step model's decode speed-up at the recipe's
    max_batch_size and a KV length of isl + osl / 2 (``trtpipe predict`` gives the served figures)."""
    from trtpipe.app import predictor as P
    from trtpipe.app.validation import load_recipe
    from trtpipe.perf.fit import load_constants

    setup = P.recipe_setup(recipe_path, overrides, gpu=gpu, model_config=model_config)
    recipe = load_recipe(recipe_path, list(overrides), check_rules=False)
    s = recipe.speculative
    if not s.enabled:
        raise TrtpipeError(
            "--acceptance-length: the recipe has no speculative decoding (set speculative.decoding_type)"
        )
    c = load_constants()[setup.family]
    step, k, _ = recipe_step(recipe, setup.deployment, c, setup.max_batch_size, isl + osl // 2, acceptance_length)
    return {
        "decoding_type": s.decoding_type,
        "max_draft_len": k,
        "acceptance_length": acceptance_length,
        "batch": step.batch,
        "kv_len": step.kv_len,
        "decode_speedup": round(step.speedup, 3),
    }


def recipe_step(recipe, target: Deployment, c: Constants, batch: int, kv_len: int, acceptance_length: float):
    """The step model for the recipe's speculation: (step, draft tokens verified per request, drafter forwards per
    step). Lookahead verifies (N - 2) + (W - 1 + G) * (N - 1) tokens; Medusa's heads run inside the verification;
    an EAGLE tree (engine eagle, Eagle3 with eagle_choices or its dynamic tree) drafts one forward per level, not one
    per node."""
    from trtpipe.recipe.lookahead import draft_len

    from trtpipe.recipe.speculative import longest_acceptance

    s = recipe.speculative
    top, what = longest_acceptance(recipe)
    if not 1 <= acceptance_length <= top:
        raise TrtpipeError(
            f"acceptance length {acceptance_length:g} is outside [1, {what} = {top}]: it counts the accepted drafts "
            "plus the target's own token per target forward"
        )
    k = draft_len(recipe)
    draft = drafter(recipe, target)
    forwards = 0 if draft is None else k  # n-gram, lookahead and Medusa run no drafter forwards
    if draft is not None and (s.decoding_type == "eagle" or (s.decoding_type == "Eagle3" and s.eagle_choices)):
        from trtpipe.recipe.eagle import choices, tree_shape

        forwards = tree_shape(choices(recipe))[0]
    elif draft is not None and s.decoding_type == "Eagle3" and s.use_dynamic_tree:
        forwards = s.max_draft_len  # the dynamic tree's depth: one forward per layer over its K best nodes
    heads, layers = medusa_heads(recipe)
    step = speculative_step(target, c, batch, kv_len, k, acceptance_length, draft, heads, layers, forwards)
    return step, k, forwards


def medusa_heads(recipe) -> tuple[int, int]:
    """(heads, residual blocks per head) the verification computes: 0 heads unless the recipe speculates with
    Medusa; the recipe's ``num_medusa_heads`` over the heads' config, else the depth of its choices."""
    s = recipe.speculative
    if s.decoding_type not in IN_VERIFY_HEADS:
        return 0, 1
    from trtpipe.recipe.medusa import choices

    cfg = _draft_config(recipe) or {}
    n = s.num_medusa_heads or int(cfg.get("medusa_num_heads") or 0) or max(len(c) for c in choices(recipe))
    return n, int(cfg.get("medusa_num_layers") or 1)


def speculative_block(
    recipe_path: Path,
    overrides: Iterable[str],
    target: Deployment,
    c: Constants,
    summary: dict,
    batch: int,
    isl: int,
    osl: int,
    acceptance_length: float,
) -> dict:
    """What ``predict`` adds for ``--acceptance-length``: the step times, the decode speed-up and the simulated
    figures scaled by it (ITL p50 divided by it; tok/s by the ratio of plain to speculative end-to-end time of a
    request at the simulated p50 TTFT and ITL)."""
    from trtpipe.app.validation import load_recipe

    recipe = load_recipe(recipe_path, list(overrides), check_rules=False)
    s = recipe.speculative
    if not s.enabled:
        raise TrtpipeError(
            "--acceptance-length: the recipe has no speculative decoding (set speculative.decoding_type)"
        )
    step, k, forwards = recipe_step(recipe, target, c, batch, isl + osl // 2, acceptance_length)
    ttft, itl = summary["ttft_ms"]["p50"], summary["itl_ms"]["p50"]
    e2e_plain, e2e_spec = ttft + (osl - 1) * itl, ttft + (osl - 1) * itl / step.speedup
    ms = lambda v: round(v * 1e3, 3)  # noqa: E731
    return {
        "decoding_type": s.decoding_type,
        "max_draft_len": k,  # lookahead: (N - 2) + (W - 1 + G) * (N - 1)
        "acceptance_length": acceptance_length,
        "batch": batch,
        "kv_len": step.kv_len,
        "plain_step_ms": ms(step.plain_s),
        "verify_step_ms": ms(step.verify_s),
        "draft_ms": ms(step.draft_s),
        "draft_forwards": forwards,
        "decode_speedup": round(step.speedup, 3),
        "itl_ms_p50": round(itl / step.speedup, 2),
        "output_tok_s": round(summary["output_tok_s"] * e2e_plain / e2e_spec, 1),
    }
