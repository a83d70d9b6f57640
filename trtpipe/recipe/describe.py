"""The recipe described for people and editors: the JSON Schema (``trtpipe schema``) and the fully resolved
recipe with every default shown (``trtpipe explain``)."""

from __future__ import annotations

from typing import Any

import yaml

from trtpipe.recipe.schema import Recipe

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Fields whose validators also accept a shorter spelling than their type says (see schema.py).
_SHORTHANDS = {
    ("EngineSection", "plugins"): {"type": "string", "description": "A preset name alone."},
    ("QuantizationSection", "exclude"): {"type": "string", "description": "One pattern alone."},
}


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a recipe file, shorthands included, for editor completion."""
    schema = Recipe.model_json_schema()
    defs = schema.get("$defs", {})
    for (model, field), alternative in _SHORTHANDS.items():
        prop = defs[model]["properties"][field]
        described = {k: prop.pop(k) for k in ("description", "default", "title") if k in prop}
        defs[model]["properties"][field] = {"anyOf": [prop, alternative], **described}
    return {"$schema": JSON_SCHEMA_DIALECT, **schema}


def _flow(value: Any) -> str:
    """A value as one line of YAML (flow style)."""
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 30, allow_unicode=True).strip()[1:-1]


def explain_yaml(recipe: Recipe, deduced: dict[str, Any] | None = None) -> str:
    """The resolved recipe as YAML; values the recipe does not set are marked ``# default``.

    Args:
        recipe: a loaded recipe (positions known, so written keys can be told from defaults).
        deduced: dotted key -> value the build will use where the default is "deduced" (e.g. max_seq_len).
    """
    deduced = deduced or {}
    lines = [f"# {recipe._display or recipe.path}: every setting; '# default' marks values the recipe does not set"]

    def note(dotted: str) -> str:
        parts = []
        if "(--set " in recipe.locate(dotted)[0]:
            parts.append("--set")
        elif not recipe.written(dotted):
            parts.append("default")
        if dotted in deduced:
            parts.append(f"deduced from the model: {deduced[dotted]}")
        return f"  # {'; '.join(parts)}" if parts else ""

    def emit(node: dict, prefix: str, indent: int) -> None:
        for key, value in node.items():
            dotted = prefix + key
            pad = "  " * indent
            if isinstance(value, dict) and value and dotted != "engine.plugins.overrides":
                lines.append(f"{pad}{key}:")
                emit(value, dotted + ".", indent + 1)
            else:
                lines.append(f"{pad}{key}: {_flow(value)}{note(dotted)}")

    emit(recipe.model_dump(mode="json"), "", 0)
    return "\n".join(lines) + "\n"


def explain(recipe: Recipe, as_json: bool = False) -> str:
    """``trtpipe explain``: every setting of a loaded and checked recipe (YAML with notes, or plain JSON)."""
    import json

    from trtpipe.recipe.rules import deduced_max_seq_len, load_model_info

    if as_json:
        return json.dumps(recipe.model_dump(mode="json"), indent=2) + "\n"
    deduced = {}
    model, _ = load_model_info(recipe)
    if model is not None and recipe.engine.max_seq_len is None:
        deduced["engine.max_seq_len"] = deduced_max_seq_len(model)
    return explain_yaml(recipe, deduced)


def _type_name(annotation: Any) -> str:
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(names) + (" \\| null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "mapping"
    return {int: "int", float: "float", str: "string", bool: "bool"}.get(
        annotation, getattr(annotation, "__name__", "?")
    )


def _bounds(field) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = [f"{signs[k]} {getattr(m, k)}" for m in field.metadata for k in signs if getattr(m, k, None) is not None]
    return ", ".join(parts)


def reference_markdown() -> str:
    """The recipe reference (every key, type, default, range), generated from the schema for recipes/README.md."""
    from pydantic import BaseModel

    from trtpipe.recipe.messages import first_model

    out: list[str] = []

    def table(model: type[BaseModel], prefix: str) -> None:
        rows, subs = [], []
        for name, field in model.model_fields.items():
            sub = first_model(field.annotation)
            if sub is not None:
                subs.append((sub, prefix + name))
                continue
            if field.is_required():
                default = "**required**"
            else:
                value = field.get_default(call_default_factory=True)
                default = f"`{_flow(value)}`"
            rows.append(
                f"| `{prefix}{name}` | {_type_name(field.annotation)} | {default} | {_bounds(field)} "
                f"| {field.description or ''} |"
            )
        if rows:
            out.append(f"\n### `{prefix.rstrip('.') or 'top level'}`\n")
            out.append("| Key | Type | Default | Range | Meaning |\n|---|---|---|---|---|")
            out.extend(rows)
        for sub, dotted in subs:
            table(sub, dotted + ".")

    table(Recipe, "")
    return "\n".join(out).lstrip("\n") + "\n"
