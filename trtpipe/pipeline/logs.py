"""Build logs: ``<work_dir>/logs/<build_id>/build.log`` plus one ``<stage>.log`` per stage that runs.

Policy: while a stage runs, everything it says goes to its log: records of any ``trtpipe.*`` logger (including
``ctx.log``), and whatever it or a child process writes to stdout (fd 1 is pointed at the log), so that
``trtpipe build --json`` prints one JSON object and nothing else on stdout. stderr is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S")
ROOT_LOGGER = "trtpipe"


def new_build_id() -> str:
    """A sortable, unique name for one build (UTC time to the microsecond, then the pid)."""
    now = datetime.now(timezone.utc)
    return f"{now:%Y%m%dT%H%M%S}.{now:%f}Z-{os.getpid()}"


class BuildLogs:
    """The log folder of one build; attach with ``with logs:`` for the whole build."""

    def __init__(self, work_dir: Path, build_id: str):
        self.dir = Path(work_dir) / "logs" / build_id
        self.build_log = self.dir / "build.log"
        self._root = logging.getLogger(ROOT_LOGGER)
        self._handler: logging.Handler | None = None
        self._saved_level = logging.NOTSET

    def stage_log(self, stage: str) -> Path:
        return self.dir / f"{stage}.log"

    def __enter__(self) -> "BuildLogs":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._handler = _file_handler(self.build_log)
        self._saved_level = self._root.level
        if self._root.getEffectiveLevel() > logging.INFO:
            self._root.setLevel(logging.INFO)
        self._root.addHandler(self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._handler is not None:
            self._root.removeHandler(self._handler)
            self._handler.close()
            self._handler = None
        self._root.setLevel(self._saved_level)

    @contextlib.contextmanager
    def capture_stage(self, stage: str) -> Iterator[logging.Logger]:
        """Send the stage's log records and stdout to ``<stage>.log``; yield the stage's logger."""
        path = self.stage_log(stage)
        handler = _file_handler(path)
        self._root.addHandler(handler)
        try:
            with _stdout_to(path):
                yield logging.getLogger(f"{ROOT_LOGGER}.stage.{stage}")
        finally:
            self._root.removeHandler(handler)
            handler.close()


def _file_handler(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")  # append: stdout shares the file
    handler.setFormatter(_FORMAT)
    handler.setLevel(logging.DEBUG)
    return handler


@contextlib.contextmanager
def _stdout_to(path: Path) -> Iterator[None]:
    """Point both ``sys.stdout`` and file descriptor 1 (child processes, C libraries) at ``path``."""
    sys.stdout.flush()
    saved_fd = os.dup(1)
    with open(path, "a", buffering=1, encoding="utf-8") as f:
        os.dup2(f.fileno(), 1)
        try:
            with contextlib.redirect_stdout(f):
                yield
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            f.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
