"""Content keys: what a stage's output depends on, hashed into a short name for its artifact folder.

A stage's key hashes, as canonical JSON:
  * its name and the key format version,
  * the resolved (defaults filled) value of every recipe section it declares,
  * the keys of the input artifacts it reads (so a change upstream changes every key downstream),
  * fingerprints of the input files it declares (path, size, mtime_ns; the sha256 of small files),
  * its ``extra_key(recipe)`` and the trtpipe version.

Policy: anything a stage did not declare cannot change its key, so an undeclared section edit keeps the cache.
Keys are computed from the recipe and the files alone, never from artifacts, so a whole build can be planned
(``trtpipe status``) before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

from trtpipe import __version__
from trtpipe.pipeline.cache import sha256_file
from trtpipe.pipeline.stage import Stage
from trtpipe.recipe.schema import Recipe

KEY_FORMAT = 1  # bump when what enters a key changes, so old artifacts are never mistaken for new ones
KEY_LENGTH = 16  # hex characters of sha256 kept in folder names (64 bits)
SMALL_FILE_BYTES = 1 << 20  # files up to this size are fingerprinted by content too


def canonical(obj: Any) -> Any:
    """``obj`` as plain JSON data with a single spelling (paths as strings, sets sorted, dict keys str).

    Raises:
        TypeError: for objects with no stable spelling (their repr could hold a memory address).
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj  # json writes floats with repr(): one spelling per value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((canonical(v) for v in obj), key=stable_json)
    if hasattr(obj, "model_dump"):
        return canonical(obj.model_dump(mode="json"))
    raise TypeError(f"cannot put a {type(obj).__name__} into a content key: {obj!r}")


def stable_json(obj: Any) -> str:
    """Canonical JSON text: sorted keys, no whitespace."""
    return json.dumps(canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _file_print(path: Path, shown: str) -> dict:
    st = path.stat()  # follows symlinks: the Hugging Face cache links snapshot files to blobs
    out = {"path": shown, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size <= SMALL_FILE_BYTES:
        out["sha256"] = sha256_file(path)
    return out


def fingerprint(path: Path) -> dict:
    """Fingerprint one declared input: a file, a directory (every file under it), or a missing path.

    Entries whose name starts with "." are left out of directories: tools keep lock files and caches there
    (``.cache/huggingface``) whose timestamps change without the content changing.
    A missing path is recorded as missing (the stage itself reports it with a proper error).
    """
    path = Path(path).expanduser().absolute()
    if path.is_file():
        return _file_print(path, str(path))
    if path.is_dir():
        files = []
        for root, dirs, names in os.walk(path, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(n for n in names if not n.startswith(".")):
                full = Path(root) / name
                files.append(_file_print(full, full.relative_to(path).as_posix()))
        return {"path": str(path), "dir": files}
    return {"path": str(path), "missing": True}


def key_material(stage: Stage, recipe: Recipe, input_keys: Mapping[str, str]) -> dict:
    """Everything that enters ``stage``'s key, as plain data (kept beside the artifact for debugging).

    Args:
        input_keys: key of each *enabled* input stage; disabled inputs are absent.
    """
    return {
        "format": KEY_FORMAT,
        "trtpipe": __version__,
        "stage": stage.name,
        "sections": {s: recipe.key_section(s) for s in stage.sections},
        "inputs": {name: input_keys[name] for name in stage.inputs if name in input_keys},
        "files": [fingerprint(p) for p in stage.files(recipe)],
        "extra": canonical(stage.extra_key(recipe)),
    }


def key_of(material: dict) -> str:
    return hashlib.sha256(stable_json(material).encode()).hexdigest()[:KEY_LENGTH]


def stage_key(stage: Stage, recipe: Recipe, input_keys: Mapping[str, str]) -> tuple[str, dict]:
    """``(key, material)`` of a stage for this recipe and these upstream keys."""
    material = key_material(stage, recipe, input_keys)
    return key_of(material), material
