"""Deploy rules for ``trtpipe validate``: replica counts, SLOs that can hold, node selection, the pod layout.

An SLO cannot hold when it is below the memory-bandwidth floor of one decode step: every generated token reads
all weights of every pipeline stage once, so ITL (and TTFT, at least one forward pass) is at least
``sum over pp stages of weight bytes per GPU / GPU bandwidth`` (planner weight sizes from config.json, catalog
bandwidth). That is a floor, not a prediction: an SLO above it may still miss.
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.deploy.layout import layout_of, node_selector, slo_targets
from trtpipe.formats.gpus import get_gpu
from trtpipe.errors import EngineError, TrtpipeError
from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe


def _key_of(message: str, default: str) -> tuple[str, str]:
    head, sep, rest = message.partition(": ")
    return (head, rest) if sep and head.startswith(("deploy.", "engine.", "llmapi.")) else (default, message)


def step_floor_s(recipe: Recipe, m: ModelDims) -> float:
    """Seconds one decode step needs at least: weight bytes of all pp stages (one TP rank) / GPU bandwidth."""
    from trtpipe.engine.ckptconfig import predicted_checkpoint_config
    from trtpipe.engine.planner import Shapes, weight_bytes

    s = Shapes.of(predicted_checkpoint_config(m, recipe))
    return sum(weight_bytes(s, recipe.parallel.tp, recipe.parallel.pp)) / (
        get_gpu(recipe.engine.gpu).bandwidth_gbs * 1e9
    )


def deploy_findings(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    d = recipe.deploy
    if d.replicas.min > d.replicas.max:
        yield "deploy.replicas", f"replicas.min {d.replicas.min} exceeds replicas.max {d.replicas.max}"
    for check in (layout_of, node_selector):
        try:
            check(recipe)
        except EngineError:  # an unknown engine.gpu: the engine rules name it
            pass
        except TrtpipeError as exc:
            yield _key_of(str(exc), "deploy")
    try:
        targets = slo_targets(recipe)
    except TrtpipeError as exc:
        yield "deploy.slo", str(exc).removeprefix("--slo: ").removeprefix("deploy.slo: ")
        return
    if m is None:
        return
    try:
        floor = step_floor_s(recipe, m)
    except (EngineError, TrtpipeError, KeyError, ValueError):  # the engine rules report what they cannot plan
        return
    for metric, (q, bound) in targets.items():
        if bound < floor:
            yield (
                "deploy.slo",
                (
                    f"{metric} p{q * 100:g} {bound * 1e3:g} ms cannot hold: one decode step reads "
                    f"{recipe.parallel.pp} pp stage(s) of weights at {get_gpu(recipe.engine.gpu).bandwidth_gbs} "
                    f"GB/s, at least {floor * 1e3:.2f} ms"
                ),
            )


DEPLOY_RULES: tuple[Rule, ...] = (deploy_findings,)
