"""Where one model instance runs: ranks per pod, pods per instance, the GPU's node labels, the SLO targets.

Policy: one pod per node. A layout of ``tp*pp`` ranks that fits one node (``deploy.gpus_per_node``) is one pod
(a Deployment replica); a larger one is a LeaderWorkerSet group of ``tp*pp / gpus_per_node`` full nodes, the leader
included (kubernetes-sigs/lws@060ab4da docs/examples/tensorrt-llm/lws.yaml: ``size: 2`` for tp2 x pp8 on 8-GPU
nodes). The GPU product label is the one NVIDIA GPU Feature Discovery puts on a node, ``nvidia.com/gpu.product``:
the ``nvidia-smi`` product name with spaces turned into dashes (e.g. ``NVIDIA-H100-80GB-HBM3``). Only catalog
cards whose name is the reported one (not ``nominal``) get it; the others need ``deploy.node_labels``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trtpipe.formats.gpus import GPU, get_gpu
from trtpipe.errors import TrtpipeError
from trtpipe.recipe.schema import Recipe
from trtpipe.slo import parse_slo, split_term

PRODUCT_LABEL = "nvidia.com/gpu.product"
SLO_METRICS = ("ttft", "itl")


@dataclass(frozen=True)
class Layout:
    world: int  # tp * pp ranks
    gpus_per_pod: int
    pods: int  # pods per instance (LWS group size; 1 = a Deployment replica)

    @property
    def multinode(self) -> bool:
        return self.pods > 1


def layout_of(recipe: Recipe) -> Layout:
    """Ranks per pod and pods per instance; raises TrtpipeError for a layout that cannot fill nodes evenly."""
    world, gpn = recipe.parallel.world_size, recipe.deploy.gpus_per_node
    nodes = recipe.llmapi.nodes if recipe.target == "llmapi" and recipe.written("llmapi.nodes") else None
    if nodes is not None:
        if world % nodes:
            raise TrtpipeError(f"llmapi.nodes: {world} ranks (tp*pp) do not divide over {nodes} nodes")
        if world // nodes > gpn:
            raise TrtpipeError(
                f"llmapi.nodes: {nodes} nodes need {world // nodes} GPUs each; deploy.gpus_per_node is {gpn}"
            )
        return Layout(world, world // nodes, nodes)
    if orchestrated(recipe):  # one tritonserver whose backend spawns both models' workers on one node
        if 2 * world > gpn:
            raise TrtpipeError(
                f"deploy.gpus_per_node: the two-model form at tp x pp {world} runs in orchestrator mode on one node "
                f"and needs {2 * world} GPUs (draft on 0..{world - 1}, target on {world}..{2 * world - 1}); "
                f"the node has {gpn}"
            )
        return Layout(world, 2 * world, 1)
    if world <= gpn:
        return Layout(world, world, 1)
    if world % gpn:
        raise TrtpipeError(
            f"deploy.gpus_per_node: {world} ranks (tp*pp) need more than one node but do not fill "
            f"nodes of {gpn} GPUs evenly (one pod per node)"
        )
    return Layout(world, gpn, world // gpn)


def orchestrated(recipe: Recipe) -> bool:
    """The engine target's two-model draft-target form at tp x pp > 1: upstream's orchestrator mode, the draft and
    the target each on GPUs of their own (trtpipe.triton.orchestrator)."""
    two = recipe.speculative.decoding_type == "draft_tokens_external"
    return recipe.target == "engine" and two and recipe.parallel.world_size > 1


def product_label(gpu: GPU) -> Optional[str]:
    """GPU Feature Discovery's ``nvidia.com/gpu.product`` value for a card, or None when not known."""
    return None if gpu.nominal else gpu.name.replace(" ", "-")


def node_selector(recipe: Recipe) -> dict[str, str]:
    """The nodeSelector of the serving pods: the GPU product label, then ``deploy.node_labels`` over it."""
    label = product_label(get_gpu(recipe.engine.gpu))
    out = {PRODUCT_LABEL: label} if label else {}
    out.update(recipe.deploy.node_labels)
    if PRODUCT_LABEL not in out:
        raise TrtpipeError(
            f"engine.gpu: {recipe.engine.gpu} has no known {PRODUCT_LABEL} node label; "
            f"set deploy.node_labels: {{{PRODUCT_LABEL}: <the label your nodes carry>}}"
        )
    return out


def slo_targets(recipe: Recipe) -> dict[str, tuple[float, float]]:
    """``deploy.slo`` as ``{"ttft": (quantile 0..1, bound in seconds), ...}``; percentile terms only."""
    out = {}
    for term, ms in parse_slo(recipe.deploy.slo, SLO_METRICS).items():
        metric, q = split_term(term)
        if q is None:
            raise TrtpipeError(
                f"deploy.slo: {term!r} bounds every request; alerts watch a percentile (write {metric}_p99=...)"
            )
        if q >= 100:
            raise TrtpipeError(f"deploy.slo: {term!r}: p100 cannot be read from a histogram; use p99 or p99.9")
        out[metric] = (q / 100.0, ms / 1000.0)
    return out
