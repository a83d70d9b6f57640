"""pydantic's validation errors in the recipe's own words: "must be ≥ 1 (got -1)", "'int3' is not allowed
(allowed: ...)", "unknown key; did you mean 'tp'?". Values are shown as YAML spells them (null, true)."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

from trtpipe.recipe.schema import Recipe

Loc = tuple[str, ...]


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
        sub = first_model(field.annotation) if field else None
        if sub is None:
            return None
        model = sub
    return model


def first_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = first_model(arg)
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
            sub = first_model(field.annotation)
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


def message(err: dict, loc: Loc) -> str:
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
    bounds = {
        "greater_than_equal": ("≥", "ge"),
        "less_than_equal": ("≤", "le"),
        "greater_than": (">", "gt"),
        "less_than": ("<", "lt"),
    }
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
