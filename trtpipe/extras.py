"""Optional dependencies: import one, or fail with one line naming the pip extra that installs it.

trtpipe's base install builds checkpoints and plans engines; plots, serving and MPI need extras (pyproject
``[project.optional-dependencies]``). Every import of an optional package inside trtpipe goes through
:func:`require`, so a user without it reads ``trtpipe report needs matplotlib: pip install 'trtpipe[bench]'``
instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from trtpipe.errors import TrtpipeError

# top-level package -> (what pip installs, the trtpipe extra that brings it)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("matplotlib", "bench"),
    "tritonclient": ("tritonclient", "serve"),
    "google": ("protobuf (with tritonclient)", "serve"),
    "pytriton": ("nvidia-pytriton", "serve"),
    "aiohttp": ("aiohttp (with tritonclient[all])", "serve"),
    "mpi4py": ("mpi4py", "mpi"),
    "dynamo": ("ai-dynamo", ""),  # not an extra: its own venv (scripts/install_dynamo.sh), numpy 2 vs pytriton's < 2
}


class MissingExtraError(TrtpipeError):
    """An optional package is not installed; the message names the extra to install."""


def require(module: str, needed_by: str) -> ModuleType:
    """``importlib.import_module(module)``; when its package is absent, a MissingExtraError
    ``"<needed_by> needs <package>: pip install 'trtpipe[<extra>]'"``.

    An ImportError from *inside* an installed package (a broken install) is not a missing extra: it propagates."""
    top = module.split(".")[0]
    package, extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is None or exc.name.split(".")[0] != top:
            raise
        how = f"pip install 'trtpipe[{extra}]'" if extra else "run it in the venv scripts/install_dynamo.sh makes"
        raise MissingExtraError(f"{needed_by} needs {package}: {how}") from None


def pyplot(needed_by: str) -> ModuleType:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed), or the one-line missing-extra error."""
    require("matplotlib", needed_by).use("Agg")
    return require("matplotlib.pyplot", needed_by)
