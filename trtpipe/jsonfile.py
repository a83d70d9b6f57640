"""Read a JSON file into a dict with trtpipe's one-line errors (``path:line:col: invalid JSON: ...``), and refuse
what no reader should open: a FIFO, device or socket where a file is expected (opening or reading it blocks, or
never ends) and a NaN or infinite number (``NaN``, ``Infinity``, ``1e999``), which Python's ``json`` accepts but
no configuration value means.

Every JSON file trtpipe reads goes through :func:`load_json` (any JSON value, parse errors left to the caller) or
:func:`read_json` (an object, every error one line); ``tests/test_jsonfile_sites.py`` finds any other."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator

from trtpipe.errors import TrtpipeError

SPECIAL_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(path: Path) -> str | None:
    """'a FIFO' / 'a character device' / ... when ``path`` (symlinks followed) is one, else None (a regular file,
    a directory, or nothing). ``stat`` never blocks, where ``open`` on a FIFO does."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((what for test, what in SPECIAL_KINDS if test(mode)), None)


def refuse_special(path: Path, error: type[TrtpipeError]) -> None:
    """Raise ``error`` naming ``path`` when it is a FIFO, device or socket (see :func:`special_kind`)."""
    what = special_kind(path)
    if what is not None:
        raise error(f"{path}: is {what}, not a regular file (reading it would block or never end)")


def refuse_special_files(directory: Path, error: type[TrtpipeError]) -> None:
    """:func:`refuse_special` for every entry of ``directory`` (not below it): a model directory's files are read
    by name (config, tokenizer, weights, index), so none of them may block."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return  # a missing or unreadable directory is the caller's error to name
    for name in names:
        refuse_special(Path(directory) / name, error)


def non_finite(data: Any, where: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted key, value)`` of every NaN or infinite number in a loaded JSON value, in file order."""
    if isinstance(data, float) and not math.isfinite(data):
        yield where, data
    elif isinstance(data, dict):
        for k, v in data.items():
            yield from non_finite(v, f"{where}.{k}" if where else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from non_finite(v, f"{where}[{i}]")


class JsonFileError(TrtpipeError, ValueError):
    """A JSON file refused by :func:`load_json` (a FIFO or device, a NaN or infinite number). A ``ValueError`` too:
    readers that treat an unreadable file as absent (state files, markers) keep doing so, and never block."""


def load_json(path: Path, error: type[TrtpipeError] = JsonFileError, finite: bool = True) -> Any:
    """The JSON value in ``path`` (UTF-8). A FIFO, device or socket is refused before it is opened, and (with
    ``finite``) a NaN or infinite number anywhere in it, naming the file and the key, as ``error``. Missing files
    (``FileNotFoundError``) and bad JSON (``json.JSONDecodeError``) are left to the caller to word.
    ``finite=False`` only for measurements (bench results), where NaN records "no value"."""
    refuse_special(path, error)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if finite:
        for key, value in non_finite(data):
            raise error(f"{path}: key '{key}': {json.dumps(value)} is not a finite number")
    return data


def read_json(path: Path, what: str, error: type[TrtpipeError]) -> dict[str, Any]:
    """The JSON object in ``path``; ``what`` completes "not found (is X?)" when the file is missing. A FIFO or
    device, or a NaN or infinite number anywhere in it, is refused naming the file (and the key)."""
    try:
        data = load_json(path, error, finite=False)
    except FileNotFoundError:
        raise error(f"{path}: not found (is {what}?)") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, found a {type(data).__name__}")
    for key, value in non_finite(data):
        raise error(f"{path}: key '{key}': {json.dumps(value)} is not a finite number")
    return data
