"""Load a recipe YAML into a validated :class:`Recipe`, with ``file:line:col`` on every error.

Errors are gathered and reported together, one line each:
``recipe.yaml:LINE:COL: dotted.key: what is wrong (allowed: ...)``.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, ValidationError

from trtpipe.errors import Problem, RecipeError
from trtpipe.recipe.schema import Recipe

Loc = tuple[str, ...]


def _positions(node: yaml.Node, prefix: Loc = ()) -> dict[Loc, tuple[int, int]]:
    """Map every dotted key path in a composed YAML tree to its 1-based (line, col)."""
    out: dict[Loc, tuple[int, int]] = {prefix: (node.start_mark.line + 1, node.start_mark.column + 1)}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = str(key_node.value)
            out[prefix + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            for loc, pos in _positions(value_node, prefix + (key,)).items():
                if loc != prefix + (key,):
                    out[loc] = pos
            # Errors about a key's value point at the value when the key is a scalar leaf.
            if not isinstance(value_node, (yaml.MappingNode, yaml.SequenceNode)):
                out[prefix + (key, "<value>")] = (value_node.start_mark.line + 1, value_node.start_mark.column + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.update(_positions(item, prefix + (str(i),)))
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1})", key_node.start_mark
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The pydantic model class that owns the mapping at ``loc`` (for did-you-mean)."""
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        sub = _first_model(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _allowed(loc: Loc) -> str:
    """'(allowed: a, b, c)' for Literal-typed fields, else ''."""
    if not loc:
        return ""
    owner = _model_at(loc[:-1])
    field = owner.model_fields.get(loc[-1]) if owner else None
    if field is None:
        return ""
    choices = _literal_choices(field.annotation)
    return f" (allowed: {', '.join(map(str, choices))})" if choices else ""


def _literal_choices(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        found = _literal_choices(arg)
        if found:
            return found
    return []


def _message(err: dict, loc: Loc) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(loc[:-1])
        names = list(owner.model_fields) if owner else []
        close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f" (allowed: {', '.join(names)})"
        return f"unknown key{hint}"
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        return f"{err['input']!r} is not allowed{_allowed(loc)}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return f"{msg} (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else msg


def _position(positions: dict[Loc, tuple[int, int]], loc: Loc) -> tuple[int, int]:
    for candidate in (loc + ("<value>",), loc):
        if candidate in positions:
            return positions[candidate]
    # A missing key: point at the nearest enclosing mapping that exists.
    for cut in range(len(loc) - 1, -1, -1):
        if loc[:cut] in positions:
            return positions[loc[:cut]]
    return (1, 1)


def apply_overrides(data: dict, overrides: Iterable[str], source: str) -> dict:
    """Apply torchtune-style ``dotted.key=value`` overrides (values parsed as YAML scalars)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError([Problem(source, 0, 0, item, "override must look like dotted.key=value")])
        key, raw = item.split("=", 1)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError([Problem(source, 0, 0, key, f"'{part}' is not a section")])
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_recipe(path: str | Path, overrides: Iterable[str] = (), check_rules: bool = True) -> Recipe:
    """Read, validate and cross-check a recipe; raise :class:`RecipeError` with every problem found."""
    path = Path(path)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([Problem(name, 0, 0, "", "recipe file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError([Problem(name, 0, 0, "", f"cannot read recipe: {exc}")]) from None
    try:
        root = yaml.compose(text, Loader=_UniqueKeyLoader)
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([Problem(name, line, col, "", f"invalid YAML: {problem}")]) from None
    if not isinstance(data, dict):
        raise RecipeError([Problem(name, 1, 1, "", "a recipe must be a YAML mapping of sections")])
    positions = _positions(root) if root is not None else {}
    data = apply_overrides(data, overrides, name)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden" and loc in positions:
                line, col = positions[loc]  # point at the unknown key itself
            else:
                line, col = _position(positions, loc)
            problems.append(Problem(name, line, col, ".".join(loc), _message(err, loc)))
        raise RecipeError(problems) from None
    recipe._path = path.resolve()
    recipe._positions = positions
    if check_rules:
        from trtpipe.recipe.rules import check_recipe

        problems = check_recipe(recipe)
        if problems:
            raise RecipeError(problems)
    return recipe
