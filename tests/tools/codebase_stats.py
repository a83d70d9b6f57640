#!/usr/bin/env python3
"""Size and shape of the codebase: lines and files per area, the largest functions, references outside the repo.

Used to show a restructuring's before and after on the same measure (run it in two checkouts):

    python tests/tools/codebase_stats.py [REPO] [--top 10] [--json]

Lines are physical lines of ``*.py`` files (blank and comment lines included, as ``wc -l`` counts them). A function's
size is its ``ast`` span, decorators excluded. An outside reference is a line in a tracked product file (everything
but ``tests/``) that points at the folder beside the checkout (``../shared``) or at one of the internal spec files
users never get.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

AREAS = {"library": "trtpipe/", "tests": "tests/", "scripts": "scripts/", "model_repo": "model_repo/"}
OUTSIDE = re.compile(
    r"\.\./shared|shared/(spec|models|data)|[Cc]ontract §|\bcontract \d|_CONTRACT\.md|LAYOUTS\.md|"
    r"EXECUTOR_SEMANTICS|ENVIRONMENT\.md|PERF_REFERENCE|BENCH_REFERENCE|PREQUANTIZED_FORMATS|"
    r"MODEL_FAMILIES|DEPLOY_AT_SCALE|UPSTREAM_CROSSCHECK|SERVING_DESIGN"
)


def tracked(repo: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(repo), "ls-files"], check=True, capture_output=True, text=True).stdout
    return [p for p in out.splitlines() if (repo / p).is_file()]


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and method in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def stats(repo: Path, top: int) -> dict:
    files = tracked(repo)
    py = [p for p in files if p.endswith(".py")]
    areas = {}
    for area, prefix in AREAS.items():
        mine = [p for p in py if p.startswith(prefix)]
        areas[area] = {
            "files": len(mine),
            "lines": sum(len((repo / p).read_text(encoding="utf-8").splitlines()) for p in mine),
        }
    funcs = sorted(
        ((n, f"{p}:{name}") for p in py if p.startswith("trtpipe/") for n, name in functions(repo / p)), reverse=True
    )
    sizes = sorted(n for n, _ in funcs)
    refs = []
    for p in files:
        if p.startswith("tests/") or p == "tests/tools/codebase_stats.py":
            continue
        try:
            text = (repo / p).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        refs += [f"{p}:{i}" for i, line in enumerate(text.splitlines(), 1) if OUTSIDE.search(line)]
    return {
        "areas": areas,
        "library_functions": len(funcs),
        "median_function_lines": sizes[len(sizes) // 2] if sizes else 0,
        "largest_functions": [{"lines": n, "where": w} for n, w in funcs[:top]],
        "outside_references": len(refs),
        "outside_reference_files": len({r.rsplit(":", 1)[0] for r in refs}),
        "outside_reference_lines": refs,
    }


def render(s: dict) -> str:
    lines = ["area        files   lines"]
    lines += [f"{a:<11} {v['files']:>5} {v['lines']:>7}" for a, v in s["areas"].items()]
    lines.append(f"library functions: {s['library_functions']} (median {s['median_function_lines']} lines)")
    lines.append("largest library functions:")
    lines += [f"  {f['lines']:>4}  {f['where']}" for f in s["largest_functions"]]
    lines.append(
        f"references to files outside the repository: {s['outside_references']} "
        f"in {s['outside_reference_files']} product files"
    )
    lines += [f"  {r}" for r in s["outside_reference_lines"][:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", nargs="?", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    s = stats(Path(a.repo), a.top)
    print(json.dumps(s, indent=2) if a.json else render(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
