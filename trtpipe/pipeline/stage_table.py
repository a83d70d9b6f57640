"""The ordered stage table of ``trtpipe build``: one row per stage, the module that defines it, nothing else.

Stages are imported lazily, so ``trtpipe build`` runs the stages whose modules exist and says which do not.
Adding a stage means adding a row here (and, for order, putting it after the stages it reads).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from trtpipe.errors import TrtpipeError
from trtpipe.pipeline.stage import Stage

# (stage name, module, attribute) in build order.
STAGE_TABLE: tuple[tuple[str, str, str], ...] = (
    ("checkpoint", "trtpipe.checkpoint.stage", "CHECKPOINT_STAGE"),
    ("calibrate", "trtpipe.quant.stage", "CALIBRATE_STAGE"),
    ("quantize", "trtpipe.quant.stage", "QUANTIZE_STAGE"),
    ("verify", "trtpipe.quant.stage", "VERIFY_STAGE"),
    ("export", "trtpipe.export.stage", "EXPORT_STAGE"),
    ("llmapi", "trtpipe.export.stage", "LLMAPI_STAGE"),
    ("engine", "trtpipe.engine.stage", "ENGINE_STAGE"),
    ("repo", "trtpipe.triton.stage", "REPO_STAGE"),
)
STAGE_NAMES: tuple[str, ...] = tuple(row[0] for row in STAGE_TABLE)


class StageLoadError(TrtpipeError):
    """A stage module exists but fails to import (a bug or a missing dependency, not a missing stage)."""


@dataclass(frozen=True)
class StageTable:
    stages: list[Stage]  # available stages, in build order
    unavailable: dict[str, str]  # stage name -> why it is not available


def load_stages(table: tuple[tuple[str, str, str], ...] = STAGE_TABLE) -> StageTable:
    """Import every stage in ``table`` (default :data:`STAGE_TABLE`) that exists.

    A module that is not there (or lacks its attribute) makes the stage unavailable. A module that is there but
    raises on import is an error: hiding it would silently drop a stage from every build.
    """
    stages: list[Stage] = []
    unavailable: dict[str, str] = {}
    for name, module_name, attr in table:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
                unavailable[name] = f"{module_name} is not implemented yet"
                continue
            raise StageLoadError(f"stage {name}: cannot import {module_name}: {exc}") from None
        except Exception as exc:
            raise StageLoadError(f"stage {name}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
        stage = getattr(module, attr, None)
        if stage is None:
            unavailable[name] = f"{module_name} does not define {attr} yet"
            continue
        if not isinstance(stage, Stage) or stage.name != name:
            raise StageLoadError(f"stage {name}: {module_name}.{attr} is not a Stage named {name!r}")
        stages.append(stage)
    return StageTable(stages, unavailable)
