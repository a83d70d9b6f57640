"""Numbers the manifests need from the build or the planner, each with a sentence saying where it came from.

- The artifact key: the sha256 over the file hashes the build manifest records for the served stage (``repo`` for
  the engine target, ``export`` for llmapi), so a new build gets a new cache directory; before any build, a hash of
  the expanded recipe and the model's config.json (and the manifests say so).
- The startup budget: 1.5 x the worst load time (the sizing rule of the Triton tutorials' EKS leader probe:
  failures x period >= 1.5 x load), where the load time is the larger of a measured ready time
  (``trtpipe bench cold --json``'s ``ready_s``, when given) and the planner's estimate for the real model: the
  bytes one pod reads (weights per GPU from ``trtpipe plan`` x GPUs per pod) over ``deploy.storage_read_gbs``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.deploy.layout import Layout
from trtpipe.errors import TrtpipeError
from trtpipe.recipe.schema import Recipe

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
        data = json.loads(manifest.read_text())
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
        return float(json.loads(Path(cold_start).read_text())["ready_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TrtpipeError(f"{cold_start}: not a `trtpipe bench cold --json` result ({exc})") from None


def startup_budget(recipe: Recipe, layout: Layout, weight_bytes_per_gpu: int, ready_s: Optional[float]) -> Sourced:
    """Seconds the startup probe allows."""
    pod_bytes = weight_bytes_per_gpu * layout.gpus_per_pod
    estimate = pod_bytes / (recipe.deploy.storage_read_gbs * 1e9)
    load = max(estimate, ready_s or 0.0)
    budget = math.ceil(LOAD_MARGIN * load)
    measured = f"measured ready {ready_s:.1f} s" if ready_s is not None else "no measured ready time given"
    return Sourced(
        budget,
        f"{LOAD_MARGIN} x max(planner: {weight_bytes_per_gpu / GiB:.2f} GiB weights per GPU x "
        f"{layout.gpus_per_pod} GPUs / deploy.storage_read_gbs {recipe.deploy.storage_read_gbs:g} "
        f"GB/s = {estimate:.1f} s; {measured}) = {budget} s",
    )


def cache_size_gib(weight_bytes_per_gpu: int, world: int) -> Sourced:
    """The artifact volume: every rank's weights once, plus 25 % for tokenizer, configs and a second build."""
    gib = max(1, math.ceil(weight_bytes_per_gpu * world * 1.25 / GiB))
    return Sourced(gib, f"1.25 x planner weights {weight_bytes_per_gpu / GiB:.2f} GiB per GPU x {world} ranks")
