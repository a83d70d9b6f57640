"""The ordered stage table of ``trtpipe build``: every stage, in build order, nothing else.

Adding a stage means importing it here and putting it after the stages it reads. The stage modules import
``trtpipe.pipeline.stage`` (the Stage type), never the runner, so importing them here makes no cycle.
"""

from __future__ import annotations

from trtpipe.stages.checkpoint import CHECKPOINT_STAGE
from trtpipe.stages.draft_engine import DRAFT_ENGINE_STAGE
from trtpipe.stages.engine import ENGINE_STAGE
from trtpipe.stages.export import EXPORT_STAGE, LLMAPI_STAGE
from trtpipe.pipeline.stage import Stage
from trtpipe.stages.quant import CALIBRATE_STAGE, QUANTIZE_STAGE, VERIFY_STAGE
from trtpipe.stages.repo import REPO_STAGE

# (stage name, stage) in build order; the name is the one recipes, --force/--from/--until and the manifest use.
STAGE_TABLE: tuple[tuple[str, Stage], ...] = (
    ("checkpoint", CHECKPOINT_STAGE),
    ("calibrate", CALIBRATE_STAGE),
    ("quantize", QUANTIZE_STAGE),
    ("export", EXPORT_STAGE),
    ("verify", VERIFY_STAGE),  # after export: a pre-quantized llmapi source is measured as exported
    ("llmapi", LLMAPI_STAGE),
    ("engine", ENGINE_STAGE),
    ("draft_engine", DRAFT_ENGINE_STAGE),  # speculative draft_tokens_external: the draft's own engine
    ("repo", REPO_STAGE),
)
STAGE_NAMES: tuple[str, ...] = tuple(name for name, _ in STAGE_TABLE)
STAGES: tuple[Stage, ...] = tuple(stage for _, stage in STAGE_TABLE)
