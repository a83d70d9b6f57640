"""Load a recipe YAML into a validated :class:`Recipe`, with ``file:line:col`` on every error.

Policy: every way a recipe can be wrong ends in one :class:`RecipeError` that lists all problems found, one
line each: ``recipe.yaml:LINE:COL: dotted.key: what is wrong (allowed: ...)``. Nothing else escapes
:func:`load_recipe` (unreadable files, bad YAML, wrong types at any depth, odd keys, overrides).
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
            raise RecipeError([
                Problem(name, *_pos(dup), ".".join(loc), f"duplicate key (first at line {_pos(first)[0]})")
                for loc, dup, first in sorted(duplicates, key=lambda d: _pos(d[1]))
            ])
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


# --- pydantic errors in plain words -------------------------------------------------------------------

_NEEDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping of keys",
    "model_attributes_type": "a mapping of keys",
}

# Fields that take more than one shape say so.
_SHAPES = {
    ("engine", "plugins"): "a preset name or a mapping (preset, overrides)",
    ("quantization", "exclude"): "a pattern or a list of patterns",
}

# What a regex `pattern` means, in words.
_PATTERNS = {
    r"^[A-Za-z0-9][A-Za-z0-9_.-]*$": "letters, digits, '_', '.', '-' only, starting with a letter or digit",
    r"^[A-Za-z0-9][\w.-]*$": "letters, digits, '_', '.', '-' only, starting with a letter or digit",
    r"^[A-Za-z0-9_.-]+$": "letters, digits, '_', '.', '-' only",
    r"^[a-z0-9][a-z0-9-]*$": "lower-case letters, digits and '-' only, e.g. h100-sxm-80gb",
}


def show(value: Any) -> str:
    """A value as the user wrote it in YAML, short enough for a one-line message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        if value.bit_length() <= 64:
            return str(value)
        try:
            return f"a {len(str(abs(value)))}-digit integer"
        except ValueError:  # beyond Python's int-to-str digit limit
            return f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return repr(text)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple, set)):
        return "a list"
    return type(value).__name__


def _model_at(loc: Loc) -> type[BaseModel] | None:
    """The pydantic model class that owns the mapping at ``loc``."""
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(part)
        sub = _first_model(field.annotation) if field else None
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


def _literal_choices(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        found = _literal_choices(arg)
        if found:
            return found
    return []


def _allowed(loc: Loc) -> str:
    """' (allowed: a, b, c)' for Literal-typed fields, else ''."""
    owner = _model_at(loc[:-1]) if loc else None
    field = owner.model_fields.get(loc[-1]) if owner else None
    choices = _literal_choices(field.annotation) if field else []
    return f" (allowed: {', '.join(map(str, choices))})" if choices else ""


def _all_fields() -> dict[str, list[str]]:
    """Every field name in the schema -> the dotted paths where it lives (for 'did you mean parallel.tp')."""
    out: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for fname, field in model.model_fields.items():
            out.setdefault(fname, []).append(prefix + fname)
            sub = _first_model(field.annotation)
            if sub is not None:
                walk(sub, prefix + fname + ".")

    walk(Recipe, "")
    return out


def _unknown_key(loc: Loc) -> str:
    owner = _model_at(loc[:-1])
    names = list(owner.model_fields) if owner else []
    allowed = f" (allowed: {', '.join(names)})" if names else ""
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean '{close[0]}'?{allowed}"
    elsewhere = [p for p in _all_fields().get(loc[-1], []) if p != ".".join(loc)]
    if elsewhere:
        return f"unknown key here; did you mean '{elsewhere[0]}'?{allowed}"
    return f"unknown key{allowed}"


def _message(err: dict, loc: Loc) -> str:
    """One pydantic error dict -> 'what is wrong (got X)' in the recipe's own words."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = f" (got {show(value)})"
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "missing":
        return "required key is missing"
    if kind == "invalid_key":
        return f"keys must be strings{got}"
    if kind == "literal_error":
        return f"{show(value)} is not allowed{_allowed(loc)}"
    if kind in _NEEDS:
        return f"must be {_SHAPES.get(loc[-2:], _NEEDS[kind])}{got}"
    bounds = {"greater_than_equal": ("≥", "ge"), "less_than_equal": ("≤", "le"), "greater_than": (">", "gt"), "less_than": ("<", "lt")}
    if kind in bounds:
        sign, key = bounds[kind]
        return f"must be {sign} {ctx.get(key)}{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "string_pattern_mismatch":
        return f"must be {_PATTERNS.get(ctx.get('pattern'), 'of the form ' + str(ctx.get('pattern')))}{got}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "value_error":  # our own validators; a whole mapping or list as "got" would say nothing
        return f"{ctx.get('error', err['msg'])}{'' if isinstance(value, (dict, list)) else got}"
    msg = err["msg"].replace("Input should be", "must be")
    return f"{msg[:1].lower()}{msg[1:]}{got}"


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
            problems.append(Problem(f"{name} (--set {set_by})", 0, 0, ".".join(loc), _message(err, loc)))
        else:
            line, col = _position(positions, loc, err["type"])
            problems.append(Problem(name, line, col, ".".join(loc), _message(err, loc)))
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


def load_recipe(path: str | Path, overrides: Iterable[str] = (), check_rules: bool = True) -> Recipe:
    """Read, validate and cross-check a recipe; raise :class:`RecipeError` with every problem found.

    Args:
        path: the recipe YAML file.
        overrides: ``dotted.key=value`` strings applied on top of the file (``--set``).
        check_rules: also run the cross-field rules of :mod:`trtpipe.recipe.rules` (reads the model's config.json).

    Raises:
        RecipeError: one problem per line; nothing else escapes.
    """
    recipe = parse_recipe(path, overrides)
    if check_rules:
        from trtpipe.recipe.rules import check_recipe

        problems = check_recipe(recipe)
        if problems:
            raise RecipeError(problems)
    return recipe
