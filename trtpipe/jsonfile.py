"""Read a JSON file into a dict with trtpipe's one-line errors (``path:line:col: invalid JSON: ...``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trtpipe.errors import TrtpipeError


def read_json(path: Path, what: str, error: type[TrtpipeError]) -> dict[str, Any]:
    """The JSON object in ``path``; ``what`` completes "not found (is X?)" when the file is missing."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: not found (is {what}?)") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found a {type(data).__name__}")
    return data
