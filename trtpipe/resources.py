"""Where trtpipe's data folders (``plugins/``, ``model_repo/``) are, in a checkout and in an installed wheel.

They live at the repository root (the layout the project documents); a wheel installs copies under
``<prefix>/share/trtpipe/`` (pyproject ``data-files``). An environment variable overrides each.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from trtpipe.errors import TrtpipeError

_ENV = {"plugins": "TRTPIPE_PLUGINS_DIR", "model_repo": "TRTPIPE_MODEL_REPO_DIR"}


def data_dir(name: str) -> Path:
    """The folder ``name`` (``plugins`` or ``model_repo``): env override, checkout, then installed copy."""
    env = os.environ.get(_ENV[name])
    if env:
        return Path(env)
    candidates = [
        Path(__file__).resolve().parents[1] / name,  # a checkout / editable install
        Path(sysconfig.get_path("data")) / "share" / "trtpipe" / name,  # pip install (data-files)
        Path(sys.prefix) / "share" / "trtpipe" / name,
    ]
    for path in candidates:
        if path.is_dir():
            return path
    raise TrtpipeError(
        f"trtpipe's {name}/ folder was not found (looked in {', '.join(map(str, candidates))}); set {_ENV[name]}"
    )
