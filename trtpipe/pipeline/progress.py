"""Progress bars for long stages (rich, on stderr so stdout stays clean for ``--json``).

Usage inside a stage::

    with ctx.progress("Calibrating", total=len(batches)) as bar:
        for batch in batches:
            ...
            bar.advance()

A disabled bar (``--json``) accepts the same calls and draws nothing.
"""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class RateColumn(ProgressColumn):
    """Items per second over rich's recent window (``task.speed``), e.g. ``12.5 req/s``."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-" if speed is None else f"{speed:.1f} {self.unit}/s", style="progress.data.speed")


class ProgressBar:
    """One task on one rich ``Progress`` display; a no-op when disabled."""

    def __init__(
        self,
        description: str,
        total: Optional[int] = None,
        disabled: bool = False,
        unit: Optional[str] = None,
        completed: float = 0,
    ):
        self.description = description
        self.unit = unit  # set: a rate column (``unit``/s) too
        self.total = total
        self.disabled = disabled
        self.completed = completed  # already done when the bar starts (a resumed job): no part of the rate
        self._progress: Optional[Progress] = None
        self._task = None

    def __enter__(self) -> "ProgressBar":
        if not self.disabled:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                *([RateColumn(self.unit)] if self.unit else []),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.completed)
        return self

    def advance(self, n: float = 1) -> None:
        self.completed += n
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, completed: Optional[float] = None, total: Optional[int] = None, description: Optional[str] = None):
        """Set absolute progress, change the total once it is known, or relabel the bar."""
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, total=total, description=description)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def progress_bar(
    description: str,
    total: Optional[int] = None,
    disabled: bool = False,
    unit: Optional[str] = None,
    completed: float = 0,
) -> ProgressBar:
    """A context-managed progress bar; see the module docstring."""
    return ProgressBar(description, total, disabled, unit, completed)
