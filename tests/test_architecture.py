"""The package's shape: no import cycles (function-local and string imports included), no private names across
modules, no import of a name its module no longer defines.

The graph comes from ``tests/tools/import_graph.py`` (the committed command that prints the same findings with their
lines). It is loaded from its file path: it is development tooling, so it is not part of the ``trtpipe`` package,
and loading one named file does not put ``tests/tools/`` on ``sys.path`` for every other test.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tests" / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


import_graph = _load_import_graph()


@pytest.fixture(scope="module")
def graph():
    return import_graph.build(ROOT)


def test_the_graph_sees_every_kind_of_import(graph):
    """Guard against a parser that finds nothing (then 'no cycles' would hold for any code)."""
    kinds = {e.kind for e in graph.edges}
    assert {"import", "local", "string", "package"} <= kinds
    assert len(graph.modules) > 100
    # the stage table imports every stage module; the commands import the library inside their functions
    edges = {(e.src, e.dst, e.kind) for e in graph.edges}
    assert ("trtpipe.app.stage_table", "trtpipe.stages.engine") in {(src, dst) for src, dst, _ in edges}
    assert any(src.startswith("trtpipe.app.commands.") and kind == "local" for src, _, kind in edges)


# The packages as layers, bottom first: a module may import its own package and any package of a lower row, never
# one of its own row or a higher one. Data flows recipe -> plan -> stages -> artifacts -> serving -> deployment; the
# application layer on top composes the library into commands. A new package must be given a row here.
LAYERS = (
    ("errors",),  # the one-line errors every layer raises
    ("jsonfile", "extras", "resources", "slo"),  # small foundation modules
    ("processes",),  # starting a process (the one Popen)
    ("supervisor",),  # the one process-group supervisor, over processes
    ("formats",),  # the quantization scheme table, number formats, GPU facts
    ("models",),  # families and the model-dimensions record
    ("recipe",),  # the recipe's schema, loader and own rules
    ("pipeline",),  # the Stage declaration, keys, artifact cache, runner, manifest
    ("checkpoint",),  # HF -> TensorRT-LLM checkpoint
    ("runtime",),  # the reference runtime
    ("quant",),  # calibration, quantization, pre-quantized importers, accuracy
    ("export",),  # unified HF / compressed-tensors checkpoints, trtllm-serve artifacts
    ("engine",),  # trtllm-build configuration, the CPU twin engine, the memory planner
    ("triton",),  # the Triton model repository, tritonserver, its client
    ("serving",),  # the executor, step engines and front ends
    ("perf",),  # cost model, predictor, simulator
    ("bench",),  # AIPerf load, server metrics, comparisons
    ("batch",),  # OpenAI Batch jobs (read the server's pressure through bench's view of it)
    ("deploy",),  # Kubernetes / Dynamo manifests, monitoring
    ("stages",),  # one module per pipeline stage, composing the packages above
    ("app",),  # commands, the rule list, the stage table, launchers
    ("cli",),  # registers the commands
)
# Imports that run up the layers, each with its reason. Keep this empty where you can.
UPWARD = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer_of() -> dict[str, int]:
    return {name: i for i, row in enumerate(LAYERS) for name in row}


def _package_edges(graph):
    for e in graph.edges:
        src, dst = _package(e.src), _package(e.dst)
        if e.kind in import_graph.GRAPH_KINDS and src != dst and src and dst:
            yield src, dst, e


def test_every_package_has_a_layer(graph):
    layer = _layer_of()
    missing = sorted({_package(m) for m in graph.modules} - set(layer) - {""})
    assert not missing, f"packages without a row in LAYERS (tests/test_architecture.py): {missing}"


def test_packages_import_downward_only(graph):
    layer = _layer_of()
    upward = [
        f"    {e.path}:{e.line} {e.src} -> {e.dst} ({e.kind})"
        for src, dst, e in _package_edges(graph)
        if layer[dst] >= layer[src] and (e.src, e.dst) not in UPWARD
    ]
    assert not upward, "imports up (or across) the package layers; move the code to its layer:\n" + "\n".join(upward)


def test_every_allowed_upward_import_still_exists(graph):
    edges = {(e.src, e.dst) for e in graph.edges}
    assert not set(UPWARD) - edges, f"stale UPWARD entries: {sorted(set(UPWARD) - edges)}"


def test_no_package_level_cycles(graph):
    """Implied by the layering while UPWARD is empty; checked on its own so an allowed exception cannot close one."""
    deps: dict[str, set[str]] = {}
    for src, dst, _ in _package_edges(graph):
        deps.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and not seen.add(n) and reaches(n, b, seen)) for n in deps.get(a, ()))

    cyclic = sorted(p for p in deps if reaches(p, p, set()))
    assert not cyclic, f"packages in an import cycle: {cyclic}"


def test_no_import_cycles(graph):
    found = import_graph.cycles(graph)
    report = "\n".join(
        " <-> ".join(c)
        + "\n"
        + "\n".join(f"    {e.path}:{e.line} {e.src} -> {e.dst} ({e.kind})" for e in import_graph.cycle_edges(graph, c))
        for c in found
    )
    assert not found, f"import cycles (python tests/tools/import_graph.py shows them too):\n{report}"


def test_no_private_names_across_modules(graph):
    uses = "\n".join(f"    {p.path}:{p.line} {p.user} uses {p.target}.{p.name} ({p.how})" for p in graph.private)
    assert not graph.private, f"private names used across modules (make them public or keep them home):\n{uses}"


def test_every_from_import_names_something_that_exists(graph):
    dead = "\n".join(f"    {u.path}:{u.line} from {u.target} import {u.name}" for u in graph.unresolved)
    assert not graph.unresolved, f"imports of names their module does not define (moved or renamed?):\n{dead}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "trtpipe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "b_imports_a",
    [
        "def f():\n    from trtpipe.a import x\n",  # function-local
        "import importlib\nimportlib.import_module('trtpipe.a')\n",  # by string
        "STAGES = (('a', 'trtpipe.a', 'A_STAGE'),)\n",  # a table of module names
        "from . import a\n",  # relative
    ],
)
def test_each_hidden_import_closes_a_cycle(tmp_path, b_imports_a):
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "from trtpipe.b import y\nx = 1\n", "b.py": b_imports_a})
    assert import_graph.cycles(import_graph.build(root)) == [["trtpipe.a", "trtpipe.b"]]


def test_not_imports_are_not_edges(tmp_path):
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from trtpipe.b import y\n",
            "b.py": "import logging, sys\nlog = logging.getLogger('trtpipe.a')\nargv = [sys.executable, '-m', 'trtpipe.a']\n"
            '"""see trtpipe.a"""\n',
        },
    )
    graph = import_graph.build(root)
    assert import_graph.cycles(graph) == []
    assert [(e.dst, e.kind) for e in graph.edges if e.src == "trtpipe.b"] == [("trtpipe.a", "subprocess")]


def test_private_uses_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "p/__init__.py": "",
            "p/a.py": "_x = 1\ndef F(_y=0):\n    return _y\n",
            "b.py": "from trtpipe.p.a import _x, F\nimport trtpipe.p.a as m\nfrom trtpipe.p import a\n"
            "def f():\n    return m._x, a._x, getattr(a, '_x'), trtpipe.p.a.__name__, F(_y=1), F(y=1)\n",
        },
    )
    got = sorted((p.target, p.name, p.how, p.line) for p in import_graph.build(root).private)
    assert got == [
        ("trtpipe.p.a", "F(_y=)", "keyword", 5),
        ("trtpipe.p.a", "_x", "attribute", 5),
        ("trtpipe.p.a", "_x", "attribute", 5),
        ("trtpipe.p.a", "_x", "from-import", 1),
        ("trtpipe.p.a", "_x", "getattr", 5),
    ]


def test_dead_imports_are_found(tmp_path):
    root = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "p/__init__.py": "import sys\nif sys:\n    from trtpipe.p import a as kept\n",
            "p/a.py": "X = 1\ntry:\n    import json\nexcept ImportError:\n    json = None\n",
            "b.py": "from trtpipe.p import a, kept\nfrom trtpipe.p.a import X, json\n"
            "def f():\n    from trtpipe.p import gone\n    from trtpipe.p.a import Y\n"
            "    import trtpipe.p.old\n    import importlib\n    importlib.import_module('trtpipe.p.older')\n",
        },
    )
    got = sorted((u.target, u.name, u.line) for u in import_graph.build(root).unresolved)
    assert got == [
        ("trtpipe.p", "gone", 4),
        ("trtpipe.p", "old", 6),
        ("trtpipe.p", "older", 8),
        ("trtpipe.p.a", "Y", 5),
    ]


def test_the_architecture_page_lists_every_module_and_import():
    """docs/architecture.md's second half is generated from this graph and LAYERS: regenerate it when they change."""
    spec = importlib.util.spec_from_file_location("architecture_doc", ROOT / "tests" / "tools" / "architecture_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.current() == module.generate(), (
        "python tests/tools/architecture_doc.py (docs/architecture.md is stale)"
    )
