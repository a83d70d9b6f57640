"""Pre-quantized checkpoints made by the real producers (ModelOpt, llm-compressor, GPTQModel), for the importer's
tests: ``prequantized(name)`` returns the fixture's directory, building every missing fixture first with
tests/tools/make_prequantized.py in the producers' venv (scripts/install_producers.sh). Builds are cached in
``$TRTPIPE_PREQUANT_DIR`` (default ``~/.cache/trtpipe/prequantized``), in a folder named after a hash of the
script and the producers' pinned versions, so editing either rebuilds from scratch. Tests skip, saying why, only
where the producers' venv is not installed. At tests/ root like numerics.py, importable from every test folder.

Layout of one fixture: tests/tools/make_prequantized.py's docstring.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "tools" / "make_prequantized.py"
REQUIREMENTS = ROOT / "scripts" / "producers-requirements.txt"
BUILD_TIMEOUT_S = 1800


@lru_cache(maxsize=1)
def _script():
    spec = importlib.util.spec_from_file_location("make_prequantized", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def names() -> list[str]:
    """Every fixture the script makes (read from its registry: needs no producer)."""
    return list(_script().registry())


def producers_python() -> Path:
    return Path(os.environ.get("TRTPIPE_PRODUCERS_PYTHON", ROOT / ".venv-producers" / "bin" / "python"))


def cache_dir() -> Path:
    key = hashlib.sha256(SCRIPT.read_bytes() + REQUIREMENTS.read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("TRTPIPE_PREQUANT_DIR", Path.home() / ".cache" / "trtpipe" / "prequantized"))
    return root / key


def build(wanted: list[str]) -> Path:
    """Build the fixtures of ``wanted`` that are not in the cache yet (all in one producer process, under a
    file lock so concurrent test processes build once); returns the cache folder."""
    out = cache_dir()
    missing = [n for n in wanted if not (out / n / "producer.json").exists()]
    if not missing:
        return out
    py = producers_python()
    if not py.exists():
        pytest.skip(f"producer venv not installed ({py} missing): run scripts/install_producers.sh")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [n for n in wanted if not (out / n / "producer.json").exists()]
        if missing:
            proc = subprocess.run(
                [str(py), str(SCRIPT), str(out), "--only", *missing],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
                raise RuntimeError(f"{SCRIPT.name} failed (exit {proc.returncode}):\n{tail}")
    return out


def prequantized(name: str) -> Path:
    """The directory of fixture ``name`` (``names()``), built on first use. Builds every fixture at once: one
    producer process imports the libraries once, which is most of the cost."""
    if name not in names():
        raise KeyError(f"unknown pre-quantized fixture {name!r}; known: {names()}")
    return build(names()) / name


def info(name: str) -> dict:
    """The fixture's producer.json."""
    return json.loads((prequantized(name) / "producer.json").read_text())
