"""Built-in evaluation and calibration sets that need no download: prose, code, arithmetic and chat.

A quantization that keeps prose can still break code (INT4 weights are the known case), and one held-out set
averages that away. These sets let the accuracy gate measure each kind of text on its own (``accuracy.slices``)
and let calibration mix them (``quantization.calibration.mix``), on any machine, offline:

* ``prose``: the docstrings of Python standard-library modules (English technical prose) of the running
  interpreter, read from the source files with :mod:`ast` (nothing is imported or executed);
* ``code``: the top-level functions and classes of the same source files, as written;
* ``arithmetic``: lines such as ``347 + 89 = 436``, generated from a seed;
* ``chat``: question/answer turns about those modules rendered with the model's own chat template (a model
  without one is refused, naming the slice).

Each set is split into two disjoint parts by a stable hash of the document's name (one in five documents is held
out for evaluation; the rest may calibrate; arithmetic uses a different seed per part), so a build that
calibrates on ``code`` is never scored on the code it was fitted to. prose and code depend on the Python
version (its standard library): the stages that read them key on it (:func:`data_version`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import random
import sys
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional

from trtpipe.errors import QuantizationError

BUILTIN = ("prose", "code", "arithmetic", "chat")
Part = Literal["evaluation", "calibration"]
HOLD_OUT = 5  # one document in HOLD_OUT is evaluation data
ARITHMETIC_SEEDS = {"evaluation": 1_000_003, "calibration": 2_000_003}  # offsets of the recipe's seed

# Pure-Python standard-library modules present in every CPython >= 3.10 (no platform-only ones, none that
# import a GUI); read as source, never imported.
MODULES = (
    "argparse", "ast", "asyncio.events", "asyncio.tasks", "base64", "bisect", "calendar", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "inspect", "ipaddress", "json.decoder", "json.encoder", "logging",
    "mailbox", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "sched", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest.case", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


def is_builtin(spec: str) -> bool:
    return spec in BUILTIN


def data_version(specs: Iterable[str]) -> Optional[str]:
    """What the built-in sets among ``specs`` depend on beyond the recipe (the standard library's version), for
    the stage keys; None when no set depends on it."""
    if any(s in ("prose", "code", "chat") for s in specs):
        return f"python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    return None


def _sources() -> Iterator[tuple[str, str, ast.Module]]:
    for name in MODULES:
        spec = importlib.util.find_spec(name) if "." not in name else _find_submodule(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        text = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
        yield name, text, ast.parse(text)


def _find_submodule(name: str):
    """find_spec of ``package.module`` without importing the package (find_spec would import it)."""
    parent = importlib.util.find_spec(name.rsplit(".", 1)[0])
    if parent is None or not parent.submodule_search_locations:
        return None
    for folder in parent.submodule_search_locations:
        path = Path(folder) / (name.rsplit(".", 1)[1] + ".py")
        if path.is_file():
            return importlib.util.spec_from_file_location(name, path)
    return None


def _part_of(key: str) -> Part:
    return "evaluation" if zlib.crc32(key.encode()) % HOLD_OUT == 0 else "calibration"


def _definitions(tree: ast.Module) -> Iterator[ast.AST]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node


@functools.lru_cache(maxsize=1)
def prose_documents() -> list[tuple[str, str]]:
    """(key, text) of every module, class and function docstring of at least 200 characters."""
    docs = []
    for name, _, tree in _sources():
        nodes = [(name, tree)] + [(f"{name}.{n.name}", n) for n in _definitions(tree)]
        for node in list(_definitions(tree)):
            if isinstance(node, ast.ClassDef):
                nodes += [(f"{name}.{node.name}.{m.name}", m) for m in _definitions(node)]
        for key, node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 200:
                docs.append((key, inspect.cleandoc(doc)))
    return docs


@functools.lru_cache(maxsize=1)
def code_documents() -> list[tuple[str, str]]:
    """(key, source) of every top-level function and class of at least 200 characters."""
    docs = []
    for name, text, tree in _sources():
        for node in _definitions(tree):
            src = ast.get_source_segment(text, node)
            if src and len(src) >= 200:
                docs.append((f"{name}.{node.name}", src))
    return docs


def _number(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def arithmetic_documents(seed: int) -> Iterator[str]:
    """Endless documents of 16 equations each (sums, differences and products of 1- to 4-digit numbers)."""
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    while True:
        lines = []
        for _ in range(16):
            op = rng.choice("+-*")
            a, b = (_number(rng, 2 if op == "*" else 4) for _ in range(2))
            lines.append(f"{a} {op} {b} = {ops[op](a, b)}")
        yield "\n".join(lines) + "\n"


def chat_documents(tokenizer, part: Part, where: str) -> list[str]:
    """Question/answer turns about standard-library functions, rendered with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise QuantizationError(
            f"{where}: the built-in 'chat' set needs the model's chat template, and its tokenizer has none"
        )
    bos = tokenizer.bos_token or ""
    out = []
    for key, doc in prose_documents():
        if _part_of(key) != part:
            continue
        turns = [
            {"role": "user", "content": f"What does {key} in the Python standard library do?"},
            {"role": "assistant", "content": doc.split("\n\n")[0]},
        ]
        text = tokenizer.apply_chat_template(turns, tokenize=False)
        out.append(text[len(bos) :] if bos and text.startswith(bos) else text)  # token_windows adds BOS
    return out


def texts(spec: str, part: Part, seed: int, tokenizer, where: str) -> Iterable[str]:
    """The documents of built-in set ``spec`` for ``part`` (the other part's documents never appear)."""
    if spec == "arithmetic":
        return arithmetic_documents(seed + ARITHMETIC_SEEDS[part])
    if spec == "chat":
        return chat_documents(tokenizer, part, where)
    docs = prose_documents() if spec == "prose" else code_documents()
    return [text for key, text in docs if _part_of(key) == part]
