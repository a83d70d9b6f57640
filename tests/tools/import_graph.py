"""The module import graph of ``trtpipe/``: its cycles, and the private names one module takes from another.

    python tests/tools/import_graph.py            # a readable report; exit 1 on a cycle, a private use or a dead import
    python tests/tools/import_graph.py --json     # the same as JSON (every edge included)
    python tests/tools/import_graph.py --root /tmp/before   # another checkout (e.g. a ``git worktree`` of an old commit)

Why a script of its own: a cycle hidden behind a function-local import or a module name in a string does not
fail at import time, so nothing else finds it. Every module under ``trtpipe/`` is parsed with :mod:`ast` (never
imported), and an edge ``A -> B`` is recorded for each way ``A`` makes ``B`` run in its own interpreter:

- ``import`` / ``from ... import`` at module level (kind ``import``) or inside a function (kind ``local``);
- ``importlib.import_module("trtpipe.x")`` / ``__import__("trtpipe.x")`` with a literal name (``importlib``);
- a module name in a table: a string literal inside a tuple, list, set or dict display that names a trtpipe
  module, optionally ``module:attr`` (``string``), as in a stage table ``("engine", "trtpipe.stages.engine", ...)``;
- importing ``trtpipe.p.m`` also runs the package ``trtpipe.p`` (``package``), recorded when ``A`` is outside it.

Not edges: ``python -m trtpipe.x`` in a subprocess's argv (another process; kind ``subprocess``, counted only),
and strings passed to other calls (``logging.getLogger("trtpipe.engine")`` names a logger, not a module).

A private name is a ``_name`` (not ``__dunder__``) of module ``B`` used in module ``A != B``: ``from B import
_name``, or ``alias._name`` / ``getattr(alias, "_name")`` where ``alias`` is bound to ``B`` by an import or
``importlib.import_module``, or a private keyword argument of a callable defined there (``Server(..., _proc=p)``).
Private attributes of objects (``server._proc``) cannot be seen without types and are not reported.

It also lists each ``from trtpipe.x import name`` where ``trtpipe.x`` binds no ``name`` at import time (a name a
move or rename left behind: inside a function such an import fails only when the function first runs).

The logic is in this file, standard library only, so it runs on any checkout without installing it;
``tests/test_architecture.py`` loads this file by its path and asserts that both lists are empty.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional

PACKAGE = "trtpipe"
GRAPH_KINDS = ("import", "local", "importlib", "string", "package")  # the kinds that make a module run here


@dataclass(frozen=True)
class Edge:
    """``src`` makes ``dst`` run, at ``path:line``, by ``kind`` (one of :data:`GRAPH_KINDS` or ``subprocess``)."""

    src: str
    dst: str
    path: str
    line: int
    kind: str


@dataclass(frozen=True)
class PrivateUse:
    """Module ``user`` uses ``target.name`` (a private name of another module) at ``path:line``."""

    user: str
    target: str
    name: str
    path: str
    line: int
    how: str  # "from-import", "attribute", "getattr" or "keyword" (a private parameter of another module's callable)


@dataclass(frozen=True)
class Unresolved:
    """``from target import name`` in module ``user``, where ``target`` defines no ``name`` and has no such submodule
    (a name left behind by a move or a rename; such an import fails only when its function first runs)."""

    user: str
    target: str
    name: str
    path: str
    line: int


@dataclass
class Graph:
    root: str
    modules: dict[str, str]  # module name -> path relative to root
    edges: list[Edge] = field(default_factory=list)
    private: list[PrivateUse] = field(default_factory=list)
    unresolved: list[Unresolved] = field(default_factory=list)

    def graph_edges(self) -> list[Edge]:
        return [e for e in self.edges if e.kind in GRAPH_KINDS and e.src != e.dst]


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``: dotted name -> file (packages by their ``__init__.py``)."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]  # trtpipe.a.b.c -> trtpipe.a, trtpipe.a.b


class _ModuleVisitor(ast.NodeVisitor):
    """The edges and private uses of one module."""

    def __init__(self, name: str, path: str, is_package: bool, modules: set[str]):
        self.name, self.path, self.modules = name, path, modules
        self.package = name if is_package else name.rpartition(".")[0]
        self.depth = 0  # > 0 inside a function
        self.edges: list[Edge] = []
        self.private: list[PrivateUse] = []
        self.aliases: dict[str, str] = {}  # local name -> module it is bound to (one table per file)
        self.imported: dict[str, str] = {}  # local name -> the trtpipe module it was imported from (``from M import``)
        self.from_imports: list[tuple[str, str, int]] = []  # (module, name, line) of each ``from M import name``
        self.argv_strings: set[int] = set()  # ids of string nodes that are a subprocess's "-m MODULE"

    # -- helpers --
    def _edge(self, dst: str, line: int, kind: str) -> None:
        new = [Edge(self.name, dst, self.path, line, kind)]
        if kind in GRAPH_KINDS:
            new += [
                Edge(self.name, parent, self.path, line, "package")
                for parent in _parents(dst)
                if not (self.name == parent or self.name.startswith(parent + "."))
            ]
        self.edges += [e for e in new if e not in self.edges]  # one edge per line, not per imported name

    def _module_of(self, text: str) -> Optional[str]:
        """The trtpipe module a string names (``trtpipe.x.y`` or ``trtpipe.x.y:attr``), else None."""
        text = text.split(":", 1)[0]
        return text if text in self.modules else None

    def _absolute(self, module: Optional[str], level: int) -> str:
        if not level:
            return module or ""
        base = self.package.split(".")
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join(base + ([module] if module else []))

    def _dotted(self, node: ast.AST) -> Optional[list[str]]:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        return [node.id] + parts[::-1]

    def _resolve_chain(self, chain: list[str]) -> Optional[tuple[str, list[str]]]:
        """``alias.sub.attr...`` -> (the longest trtpipe module it names, the attributes after it)."""
        if chain[0] not in self.aliases:
            return None
        module, rest = self.aliases[chain[0]], chain[1:]
        while rest and f"{module}.{rest[0]}" in self.modules:
            module, rest = f"{module}.{rest[0]}", rest[1:]
        return module, rest

    def _owner(self, func: list[str]) -> Optional[str]:
        """The trtpipe module that defines a called name (``f`` from ``from M import f``, or ``alias.f``)."""
        if len(func) == 1:
            return self.imported.get(func[0])
        resolved = self._resolve_chain(func) if func else None
        return resolved[0] if resolved and len(resolved[1]) == 1 else None

    def _import_kind(self) -> str:
        return "local" if self.depth else "import"

    # -- scopes --
    def visit_FunctionDef(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    # -- imports --
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] != PACKAGE:
                continue
            target = a.name
            while target not in self.modules and "." in target:
                target = target.rpartition(".")[0]
            if target != a.name:  # import trtpipe.x.gone
                self.from_imports.append((target, a.name[len(target) + 1 :].split(".")[0], node.lineno))
            if target in self.modules:
                self._edge(target, node.lineno, self._import_kind())
            if a.asname:
                self.aliases[a.asname] = target
            else:
                self.aliases[PACKAGE] = PACKAGE

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute(node.module, node.level)
        if base.split(".")[0] != PACKAGE:
            return
        for a in node.names:
            sub = f"{base}.{a.name}"
            if sub in self.modules:  # from trtpipe.a import b (a module)
                self._edge(sub, node.lineno, self._import_kind())
                self.aliases[a.asname or a.name] = sub
                continue
            if base in self.modules:
                self._edge(base, node.lineno, self._import_kind())
                self.imported[a.asname or a.name] = base
                self.from_imports.append((base, a.name, node.lineno))
                if _is_private(a.name) and base != self.name:
                    self.private.append(PrivateUse(self.name, base, a.name, self.path, node.lineno, "from-import"))

    # -- calls: importlib, getattr, subprocess argv --
    def visit_Call(self, node: ast.Call) -> None:
        func = self._dotted(node.func) or []
        literal = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        if func in (["importlib", "import_module"], ["import_module"], ["__import__"]) and isinstance(literal, str):
            target = self._module_of(literal)
            if target:
                self._edge(target, node.lineno, "importlib")
            elif literal.split(".")[0] == PACKAGE:  # importlib.import_module("trtpipe.x.gone")
                parent, _, rest = literal.rpartition(".")
                self.from_imports.append((parent, rest, node.lineno))
        owner = self._owner(func)
        for kw in node.keywords:
            if owner and kw.arg and _is_private(kw.arg) and owner != self.name:
                self.private.append(
                    PrivateUse(self.name, owner, f"{'.'.join(func)}({kw.arg}=)", self.path, node.lineno, "keyword")
                )
        if func == ["getattr"] and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            chain = self._dotted(node.args[0])
            resolved = self._resolve_chain(chain) if chain else None
            name = node.args[1].value
            if (
                resolved
                and not resolved[1]
                and isinstance(name, str)
                and _is_private(name)
                and resolved[0] != self.name
            ):
                self.private.append(PrivateUse(self.name, resolved[0], name, self.path, node.lineno, "getattr"))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        """``m = importlib.import_module("trtpipe.x")`` binds ``m`` to that module."""
        call = node.value
        if (
            isinstance(call, ast.Call)
            and (self._dotted(call.func) or [])[-1:] == ["import_module"]
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            target = self._module_of(call.args[0].value)
            for t in node.targets:
                if target and isinstance(t, ast.Name):
                    self.aliases[t.id] = target
        self.generic_visit(node)

    # -- tables of module names --
    def _table(self, node) -> None:
        elts = list(node.keys) + list(node.values) if isinstance(node, ast.Dict) else list(node.elts)
        for prev, elt in zip([None] + elts[:-1], elts):
            if not (isinstance(elt, ast.Constant) and isinstance(elt.value, str)):
                continue
            target = self._module_of(elt.value)
            if not target:
                continue
            after_m = isinstance(prev, ast.Constant) and prev.value == "-m"
            self._edge(target, elt.lineno, "subprocess" if after_m else "string")
        self.generic_visit(node)

    visit_Tuple = visit_List = visit_Set = visit_Dict = _table

    # -- private attributes of other modules --
    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = self._dotted(node)
        resolved = self._resolve_chain(chain) if chain else None
        if resolved and resolved[1] and _is_private(resolved[1][0]) and resolved[0] != self.name:
            self.private.append(PrivateUse(self.name, resolved[0], resolved[1][0], self.path, node.lineno, "attribute"))
            return  # the chain's inner nodes are the same use
        self.generic_visit(node)


def top_level_names(tree: ast.Module) -> Optional[set[str]]:
    """The names a module binds at import time (defs, classes, assignments, imports, also under top-level
    ``if`` / ``try``); None when it has ``from x import *`` or a module ``__getattr__`` (anything may exist)."""
    names: set[str] = set()

    def bind(target) -> None:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names.add(n.id)

    def scan(body) -> bool:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return False
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    bind(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, (ast.For, ast.With)):
                bind(
                    node.target
                    if isinstance(node, ast.For)
                    else ast.Tuple([i.optional_vars for i in node.items if i.optional_vars], ast.Load())
                )
                if not scan(node.body):
                    return False
            elif isinstance(node, (ast.If, ast.Try, ast.While)):
                for part in (
                    node.body,
                    getattr(node, "orelse", []),
                    getattr(node, "finalbody", []),
                    *[h.body for h in getattr(node, "handlers", [])],
                ):
                    if not scan(part):
                        return False
        return "__getattr__" not in names

    return names if scan(tree.body) else None


def build(root: Path) -> Graph:
    """Parse every module under ``root/trtpipe`` and return its import graph and private uses."""
    root = Path(root).resolve()
    files = module_names(root)
    graph = Graph(str(root), {m: str(p.relative_to(root)) for m, p in files.items()})
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in files.items()}
    defined = {name: top_level_names(tree) for name, tree in trees.items()}
    for name, path in files.items():
        v = _ModuleVisitor(name, graph.modules[name], path.name == "__init__.py", set(files))
        v.visit(trees[name])
        graph.edges += v.edges
        graph.private += v.private
        graph.unresolved += [
            Unresolved(name, target, what, graph.modules[name], line)
            for target, what, line in v.from_imports
            if what != "*" and (target not in defined or defined[target] is not None and what not in defined[target])
        ]
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, largest first."""
    succ: dict[str, set[str]] = {m: set() for m in graph.modules}
    for e in graph.graph_edges():
        succ[e.src].add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:  # recursion depth is bounded by the number of modules (~150)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(succ):
        if v not in index:
            strongconnect(v)
    return sorted(found, key=lambda c: (-len(c), c))


def cycle_edges(graph: Graph, component: Iterable[str]) -> list[Edge]:
    members = set(component)
    return sorted(
        (e for e in graph.graph_edges() if e.src in members and e.dst in members), key=lambda e: (e.src, e.dst, e.line)
    )


def summary(graph: Graph) -> dict:
    comps = cycles(graph)
    kinds: dict[str, int] = {}
    for e in graph.edges:
        if e.src != e.dst:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
    return {
        "root": graph.root,
        "modules": len(graph.modules),
        "edges_by_kind": dict(sorted(kinds.items())),
        "cycles": [{"modules": c, "edges": [asdict(e) for e in cycle_edges(graph, c)]} for c in comps],
        "private_uses": [asdict(p) for p in sorted(graph.private, key=lambda p: (p.path, p.line))],
        "unresolved_imports": [asdict(u) for u in sorted(graph.unresolved, key=lambda u: (u.path, u.line))],
        "edges": [asdict(e) for e in graph.edges if e.src != e.dst],
    }


def text_report(s: dict) -> str:
    lines = [
        f"{s['root']}: {s['modules']} modules; edges by kind: "
        + ", ".join(f"{k} {n}" for k, n in s["edges_by_kind"].items())
    ]
    lines.append(f"cycles (strongly connected components of more than one module): {len(s['cycles'])}")
    for i, c in enumerate(s["cycles"], 1):
        lines.append(f"  {i}. {' <-> '.join(c['modules'])}")
        for e in c["edges"]:
            lines.append(f"       {e['path']}:{e['line']}  {e['src']} -> {e['dst']}  ({e['kind']})")
    lines.append(f"private names used across modules: {len(s['private_uses'])}")
    for p in s["private_uses"]:
        lines.append(f"  {p['path']}:{p['line']}  {p['user']} uses {p['target']}.{p['name']}  ({p['how']})")
    lines.append(f"imports of names their module does not define: {len(s['unresolved_imports'])}")
    for u in s["unresolved_imports"]:
        lines.append(f"  {u['path']}:{u['line']}  from {u['target']} import {u['name']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[2],
        help="the checkout whose trtpipe/ is read (default: this repository)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON (every edge included)")
    args = ap.parse_args(argv)
    if not (args.root / PACKAGE).is_dir():
        print(f"{args.root}: no {PACKAGE}/ package directory", file=sys.stderr)
        return 2
    s = summary(build(args.root))
    print(json.dumps(s, indent=1) if args.json else text_report(s))
    return 1 if s["cycles"] or s["private_uses"] or s["unresolved_imports"] else 0


if __name__ == "__main__":
    sys.exit(main())
