"""What a build stage is: a plain function plus the declaration of what it reads.

The runner (``trtpipe.pipeline.runner``) hashes what a stage declares into its content key, gives it a
temporary output directory and renames that into ``<work_dir>/artifacts/<stage>/<key>/`` only when the
function returns. Stage functions never write anywhere but ``ctx.out_dir`` (and ``ctx.log``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from trtpipe.recipe.schema import Recipe


@dataclass
class StageContext:
    recipe: Recipe
    out_dir: Path  # temporary directory; becomes the artifact when run() returns
    inputs: dict[str, Path]  # artifact directory of each declared input stage
    log: logging.Logger
    work_dir: Path
    quiet: bool = False  # --json: no progress bars
    info: dict[str, Any] = field(default_factory=dict)  # stage results recorded into the manifest

    def progress(self, description: str, total: Optional[int] = None):
        """A rich progress bar (a no-op bar when quiet). Use as a context manager; call .advance(n)."""
        from trtpipe.pipeline.progress import progress_bar

        return progress_bar(description, total, disabled=self.quiet)


@dataclass(frozen=True)
class Stage:
    """A build stage.

    Attributes:
        name: artifact folder name and CLI name (``--force NAME``).
        sections: dotted recipe sections whose resolved values enter the key (e.g. ``"quantization"``).
        inputs: earlier stages whose artifacts this one reads (their keys enter this key).
        files: recipe -> input files/dirs outside the work dir (model weights, calibration data) whose
            fingerprints (path, size, mtime_ns; sha256 for small files) enter the key.
        run: the work. Raise a ``TrtpipeError`` subclass on bad input.
        enabled: recipe -> whether this stage applies (e.g. calibrate only when quantizing).
        extra_key: recipe -> anything else that must change the key (e.g. the installed TensorRT-LLM version).
        unkeyed: recipe fields ``run`` reads that cannot change what it writes, each with its reason in a comment
            (tests/pipeline/test_stage_keys.py holds every other field ``run`` reads to the key).
    """

    name: str
    sections: tuple[str, ...]
    inputs: tuple[str, ...]
    run: Callable[[StageContext], None]
    files: Callable[[Recipe], list[Path]] = lambda recipe: []
    enabled: Callable[[Recipe], bool] = lambda recipe: True
    extra_key: Callable[[Recipe], Any] = lambda recipe: None
    unkeyed: tuple[str, ...] = ()
    description: str = ""
