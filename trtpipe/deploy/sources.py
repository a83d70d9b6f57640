"""Numbers the manifests need from the build or the planner, each with a sentence saying where it came from.

- The artifact key: the sha256 over the file hashes the build manifest records for the served stage (``repo`` for
  the engine target, ``export`` for llmapi), so a new build gets a new cache directory; before any build, a hash of
  the expanded recipe and the model's config.json (and the manifests say so).
- The startup budget: 1.5 x the start time (the sizing rule of the Triton tutorials' EKS leader probe:
  failures x period >= 1.5 x load), never under a floor. The start time is the fixed start cost (process start,
  engine deserialization's copy to the GPUs, CUDA contexts, KV allocation, warm-up and the ranks' rendezvous, each
  with its source; or, when given, the measured ``ready_s`` of ``trtpipe bench cold --json``) plus the load time: the bytes one pod reads (weights per GPU from
  ``trtpipe plan`` x GPUs per pod) over ``deploy.storage_read_gbs``. Every term is written in the source sentence.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.deploy.layout import Layout
from trtpipe.errors import TrtpipeError
from trtpipe.recipe.schema import Recipe
from trtpipe.jsonfile import load_json

SERVED_STAGE = {"engine": "repo", "llmapi": "export"}
LOAD_MARGIN = 1.5
GiB = 1 << 30


@dataclass(frozen=True)
class Sourced:
    value: object
    source: str  # one sentence


def artifact_key(recipe: Recipe) -> Sourced:
    """A 16-hex content key of what the pods serve."""
    stage = SERVED_STAGE[recipe.target]
    manifest = recipe.work_path / "manifest.json"
    shown = f"{recipe.work_dir}/manifest.json"  # as the recipe writes it: no machine paths in manifests
    if manifest.is_file():
        data = load_json(manifest)
        entry = next((s for s in data.get("stages", []) if s.get("name") == stage and s.get("files")), None)
        if entry:
            lines = "".join(f"{p} {f['sha256']}\n" for p, f in sorted(entry["files"].items()))
            key = hashlib.sha256(lines.encode()).hexdigest()[:16]
            return Sourced(
                key,
                f"sha256 over the {len(entry['files'])} file hashes of stage {stage} in build "
                f"{data.get('build_id')} ({shown})",
            )
    config = Path(recipe.resolve(recipe.model.source)) / "config.json"
    text = recipe.model_dump_json() + (config.read_text() if config.is_file() else "")
    return Sourced(
        hashlib.sha256(text.encode()).hexdigest()[:16],
        f"not built yet (no stage {stage} in {shown}): sha256 of the expanded recipe and the model's "
        "config.json; rerun trtpipe deploy after the build to key the cache by the artifacts' content",
    )


def measured_ready_s(cold_start: Optional[Path]) -> Optional[float]:
    if cold_start is None:
        return None
    try:
        return float(load_json(Path(cold_start))["ready_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TrtpipeError(f"{cold_start}: not a `trtpipe bench cold --json` result ({exc})") from None


# Fixed start costs that no byte count gives, seconds, each with where the number comes from.
PROCESS_START_S = 37.0
PROCESS_START_SOURCE = (
    "process start: tritonserver and its python models ready with 0.5 MB of weights in 26.7-37.2 s "
    "(trtpipe bench cold, stories-fp16, docs/results/bench/coldstart.json)"
)
H2D_GBS = 64.0
H2D_SOURCE = (
    "engine deserialization: every GPU's weights copied host to device over PCIe Gen5 x16 at 64 GB/s "
    "(the H100/H200 host interface, NVIDIA H100 datasheet; PCI-SIG PCIe 5.0)"
)
INIT_S = 300.0
INIT_SOURCE = (
    "CUDA contexts, KV allocation, warm-up and the ranks' barrier (MPI rendezvous): a 1.1B TinyLlama ctx/gen pp4 "
    "ran past a 300 s readiness deadline still initializing and warming up (NVIDIA/TensorRT-LLM#19402)"
)
FLOOR_S = 600
FLOOR_SOURCE = (
    "floor: TensorRT-LLM's own harness waits 600 s for a server to be ready "
    "(NVIDIA/TensorRT-LLM tests/unittest/llmapi/apps/openai_server.py, RemoteOpenAIServer.MAX_SERVER_START_WAIT_S)"
)


def start_terms(
    recipe: Recipe, layout: Layout, weight_bytes_per_gpu: int, ready_s: Optional[float] = None
) -> list[tuple[str, float, str]]:
    """``(name, seconds, source)`` of each part of a cold start of one instance: the fixed start costs (or, when
    given, the measured ready time of ``trtpipe bench cold`` in their place) and the weights' load time."""
    pod_bytes = weight_bytes_per_gpu * layout.gpus_per_pod
    gbs = recipe.deploy.storage_read_gbs
    if ready_s is None:
        fixed = [
            ("process", PROCESS_START_S, PROCESS_START_SOURCE),
            ("deserialize", weight_bytes_per_gpu / (H2D_GBS * 1e9), H2D_SOURCE),
            ("init", INIT_S, INIT_SOURCE),
        ]
    else:
        fixed = [("measured", ready_s, "fixed start cost: measured ready time (trtpipe bench cold --json ready_s)")]
    load = (
        "load",
        pod_bytes / (gbs * 1e9),
        f"weights read: planner {weight_bytes_per_gpu / GiB:.2f} GiB per GPU x {layout.gpus_per_pod} GPUs / "
        f"deploy.storage_read_gbs {gbs:g} GB/s",
    )
    return [*fixed, load]


def startup_budget(recipe: Recipe, layout: Layout, weight_bytes_per_gpu: int, ready_s: Optional[float]) -> Sourced:
    """Seconds the startup probe allows: ``max(floor, ceil(1.5 x sum of the start terms))``."""
    terms = start_terms(recipe, layout, weight_bytes_per_gpu, ready_s)
    start = sum(seconds for _, seconds, _ in terms)
    budget = max(FLOOR_S, math.ceil(LOAD_MARGIN * start))
    parts = " + ".join(f"{name} {seconds:.1f} s ({source})" for name, seconds, source in terms)
    return Sourced(
        budget, f"max({FLOOR_S} s, {LOAD_MARGIN} x {start:.1f} s) = {budget} s; {start:.1f} s = {parts}; {FLOOR_SOURCE}"
    )


def cache_size_gib(weight_bytes_per_gpu: int, world: int) -> Sourced:
    """The artifact volume: every rank's weights once, plus 25 % for tokenizer, configs and a second build."""
    gib = max(1, math.ceil(weight_bytes_per_gpu * world * 1.25 / GiB))
    return Sourced(gib, f"1.25 x planner weights {weight_bytes_per_gpu / GiB:.2f} GiB per GPU x {world} ranks")
