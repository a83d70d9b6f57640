"""trtpipe's own error types. Every user-facing failure is one of these: one line per problem."""

from __future__ import annotations

from dataclasses import dataclass


class TrtpipeError(Exception):
    """Base class: the CLI prints ``str(exc)`` and exits non-zero, without a traceback."""

    exit_code = 1


@dataclass(frozen=True)
class Problem:
    """One problem in a file: ``file:line:col: key: message``. line 0 means 'the whole file'."""

    file: str
    line: int
    col: int
    key: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line else self.file
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class RecipeError(TrtpipeError):
    """A recipe that does not validate. Carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class CheckpointError(TrtpipeError):
    """A Hugging Face or TensorRT-LLM checkpoint that cannot be read or converted (names the tensor or key)."""


class QuantizationError(TrtpipeError):
    """Calibration or quantization that cannot proceed (names the layer, tensor or setting)."""


class AccuracyGateError(TrtpipeError):
    """The recipe's accuracy gate failed; the message carries the measured numbers."""


class EngineError(TrtpipeError):
    """Engine planning or building failed (names the setting to change)."""


class ServingError(TrtpipeError):
    """Triton repository generation, server launch or a request failed."""


class StageError(TrtpipeError):
    """A pipeline stage failed; the message names the stage and the log file."""
