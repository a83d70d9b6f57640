"""Load a recipe YAML into a validated :class:`Recipe`, with ``file:line:col`` on every error.

Policy: every way a recipe can be wrong ends in one :class:`RecipeError` that lists all problems found, one
line each: ``recipe.yaml:LINE:COL: dotted.key: what is wrong (allowed: ...)``. Nothing else escapes
:func:`parse_recipe` (unreadable files, bad YAML, wrong types at any depth, odd keys, overrides). The
cross-field rules run after it, in :func:`trtpipe.app.validation.load_recipe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from trtpipe.errors import Problem, RecipeError
from trtpipe.recipe.messages import message, show
from trtpipe.recipe.schema import Recipe

Loc = tuple[str, ...]
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of YAML; anything bigger is the wrong file

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _RecipeYAMLLoader(yaml.SafeLoader):
    """SafeLoader that reads dates as text and accepts only scalar keys (duplicates are found by :func:`_walk`)."""


# A recipe has no dates: `name: 2024-01-01` is the string it looks like.
_RecipeYAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _construct_mapping(loader: _RecipeYAMLLoader, node: yaml.MappingNode, deep: bool = False):
    for key_node, _ in node.value:
        if key_node.tag != _MERGE_TAG and not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(None, None, "keys must be plain names", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_RecipeYAMLLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _walk(root: yaml.Node) -> tuple[dict[Loc, tuple[int, int]], list[tuple[Loc, yaml.Node, yaml.Node]]]:
    """Map every dotted key path in a composed YAML tree to its 1-based (line, col); find duplicate keys.

    ``loc + ("<value>",)`` is where a scalar value starts, so type errors point at the value. Aliased nodes are
    walked once (a YAML "billion laughs" must not take forever here).

    Returns:
        (positions, duplicates): duplicates are (dotted key, repeated key node, first key node).
    """
    out: dict[Loc, tuple[int, int]] = {}
    duplicates: list[tuple[Loc, yaml.Node, yaml.Node]] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, Loc]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        out.setdefault(prefix, _pos(node))
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, yaml.Node] = {}
            for key_node, value_node in node.value:
                key = prefix + (str(key_node.value),)
                if key_node.tag != _MERGE_TAG:
                    if key[-1] in first:
                        duplicates.append((key, key_node, first[key[-1]]))
                        continue
                    first[key[-1]] = key_node
                out.setdefault(key, _pos(key_node))
                if isinstance(value_node, yaml.ScalarNode):
                    out.setdefault(key + ("<value>",), _pos(value_node))
                else:
                    stack.append((value_node, key))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out.setdefault(prefix + (str(i),), _pos(item))
                if isinstance(item, yaml.ScalarNode):
                    out.setdefault(prefix + (str(i), "<value>"), _pos(item))
                else:
                    stack.append((item, prefix + (str(i),)))
    return out, duplicates


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    problem, context = exc.problem, exc.context
    if problem and context:
        return f"{problem} ({context})"
    return problem or context or "cannot parse"


def _parse(name: str, text: str) -> tuple[Any, dict[Loc, tuple[int, int]]]:
    """YAML text -> (data, positions); every YAML failure becomes a RecipeError with its position."""
    loader = None
    try:
        loader = _RecipeYAMLLoader(text)
        root = loader.get_single_node()
        positions, duplicates = _walk(root) if root is not None else ({}, [])
        if duplicates:
            raise RecipeError(
                [
                    Problem(name, *_pos(dup), ".".join(loc), f"duplicate key (first at line {_pos(first)[0]})")
                    for loc, dup, first in sorted(duplicates, key=lambda d: _pos(d[1]))
                ]
            )
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        raise RecipeError([Problem(name, line, col, "", f"invalid YAML: {_yaml_problem(exc)}")]) from None
    except yaml.reader.ReaderError as exc:  # a control character: positioned by character offset
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - text.rfind("\n", 0, exc.position)
        raise RecipeError([Problem(name, line, col, "", f"invalid YAML: {_first_line(exc)}")]) from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
        # ValueError: e.g. an integer literal longer than Python's 4300-digit limit.
        raise RecipeError([Problem(name, 0, 0, "", f"invalid YAML: {_first_line(exc)}")]) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, positions


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _position(positions: dict[Loc, tuple[int, int]], loc: Loc, kind: str) -> tuple[int, int]:
    if kind not in ("extra_forbidden", "invalid_key") and loc + ("<value>",) in positions:
        return positions[loc + ("<value>",)]
    if loc in positions:
        return positions[loc]
    # A missing key: point at the nearest enclosing mapping that exists.
    for cut in range(len(loc) - 1, -1, -1):
        if loc[:cut] in positions:
            return positions[loc[:cut]]
    return (1, 1)


# --- overrides ----------------------------------------------------------------------------------------


def apply_overrides(data: dict, overrides: Iterable[str], source: str) -> dict[Loc, str]:
    """Apply torchtune-style ``dotted.key=value`` overrides in place (values parsed as YAML scalars).

    Returns: the dotted keys that were set, each mapped to the override text (errors about them name it).
    """
    applied: dict[Loc, str] = {}
    problems: list[Problem] = []
    for item in overrides:
        where = f"{source} (--set {item})"
        key, eq, raw = item.partition("=")
        parts = tuple(key.strip().split("."))
        if not eq or not all(parts):
            problems.append(Problem(where, 0, 0, "", "an override must look like dotted.key=value"))
            continue
        try:
            value = yaml.load(raw, Loader=_RecipeYAMLLoader) if raw.strip() else None
        except yaml.MarkedYAMLError as exc:
            problems.append(Problem(where, 0, 0, key, f"value is not valid YAML: {_yaml_problem(exc)}"))
            continue
        except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            problems.append(Problem(where, 0, 0, key, f"value is not valid YAML: {_first_line(exc)}"))
            continue
        node = data
        for i, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(Problem(where, 0, 0, ".".join(parts[: i + 1]), "is not a section"))
                break
        else:
            node[parts[-1]] = value
            applied[parts] = item
    if problems:
        raise RecipeError(problems)
    return applied


# --- the entry point ----------------------------------------------------------------------------------


def _read(path: Path) -> str:
    name = str(path)
    try:
        if path.is_dir():
            raise RecipeError([Problem(name, 0, 0, "", "is a directory, not a recipe file")])
        if path.exists() and not path.is_file():  # a FIFO or device would block or never end
            raise RecipeError([Problem(name, 0, 0, "", "is not a regular file")])
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError([Problem(name, 0, 0, "", f"is {size} bytes; a recipe is a small YAML file")])
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError([Problem(name, 0, 0, "", "recipe file not found")]) from None
    except (OSError, ValueError) as exc:
        raise RecipeError([Problem(name, 0, 0, "", f"cannot read recipe: {_first_line(exc)}")]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        col = exc.start - data.rfind(b"\n", 0, exc.start)
        raise RecipeError([Problem(name, line, col, "", f"not UTF-8 text (byte {exc.start})")]) from None


def _validation_problems(exc: ValidationError, name: str, positions: dict, overridden: dict[Loc, str]) -> list[Problem]:
    problems = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        set_by = next((overridden[loc[:cut]] for cut in range(len(loc), 0, -1) if loc[:cut] in overridden), None)
        if set_by is not None:
            problems.append(Problem(f"{name} (--set {set_by})", 0, 0, ".".join(loc), message(err, loc)))
        else:
            line, col = _position(positions, loc, err["type"])
            problems.append(Problem(name, line, col, ".".join(loc), message(err, loc)))
    problems.sort(key=lambda p: (p.line, p.col))
    return problems


def parse_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read and schema-validate a recipe (no cross-field rules, no model access)."""
    path = Path(path)
    name = str(path)
    data, positions = _parse(name, _read(path))
    if not isinstance(data, dict):
        raise RecipeError([Problem(name, 1, 1, "", f"a recipe must be a YAML mapping of sections (got {show(data)})")])
    overridden = apply_overrides(data, overrides, name)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_validation_problems(exc, name, positions, overridden)) from None
    try:
        recipe._path = path.resolve()
    except (OSError, RuntimeError):
        recipe._path = path.absolute()
    recipe._display = name
    recipe._positions = positions
    recipe._overrides = overridden
    return recipe
