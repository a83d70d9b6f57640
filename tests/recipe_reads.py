"""Which recipe fields a piece of code reads: the check that a stage's content key covers what its writers read.

:func:`recipe_reads` records, while its block runs, every field of ``recipe`` (or of a section of it) that is read by
attribute or dumped whole (``model_dump``), as dotted paths (``"serving.request_timeout_s"``); asking a section which
fields the recipe wrote (``model_fields_set``) is recorded as ``"<section>.model_fields_set"``. Only the sections of
this one recipe object are recorded, so recipes built inside the block (schema defaults) are not.
:func:`unkeyed` then names the reads that no stage section covers: the stage's own sections and those of every stage
it reads (their keys enter its key).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

from pydantic import BaseModel

from trtpipe.pipeline.stage import Stage
from trtpipe.recipe.schema import Recipe, _Section


def _section_paths(node: BaseModel, path: str, out: dict[int, str]) -> dict[int, str]:
    out[id(node)] = path
    for name in type(node).model_fields:
        child = node.__dict__.get(name)
        if isinstance(child, BaseModel):
            _section_paths(child, f"{path}.{name}" if path else name, out)
    return out


@contextmanager
def recipe_reads(recipe: Recipe) -> Iterator[set[str]]:
    """Yields the set (filled while the block runs) of dotted recipe fields read, reduced to the deepest ones."""
    paths = _section_paths(recipe, "", {})
    seen: set[str] = set()
    dumped: set[str] = set()
    dump = _Section.model_dump

    def get(self, name):
        base = paths.get(id(self))
        # model_fields_set (which fields the recipe wrote) is a read of its own: "engine.kv_cache.model_fields_set"
        if base is not None and (name in type(self).model_fields or name == "model_fields_set"):
            seen.add(f"{base}.{name}" if base else name)
        return object.__getattribute__(self, name)

    def model_dump(self, *args, **kwargs):
        base = paths.get(id(self))
        if base is not None:
            dumped.add(base or "*")
        return dump(self, *args, **kwargs)

    reads: set[str] = set()
    _Section.__getattribute__ = get
    _Section.model_dump = model_dump
    try:
        yield reads
    finally:
        del _Section.__getattribute__
        del _Section.model_dump
        reads.update(p for p in seen if not any(q.startswith(p + ".") for q in seen))
        reads.update(dumped)


def keyed_sections(stage: Stage, stages: Iterable[Stage]) -> set[str]:
    """The recipe sections that enter ``stage``'s key: its own and (through their keys) its inputs', transitively."""
    by_name = {s.name: s for s in stages}
    out = set(stage.sections)
    for name in stage.inputs:
        out |= keyed_sections(by_name[name], by_name.values())
    return out


def unkeyed(reads: Iterable[str], sections: Iterable[str]) -> list[str]:
    """The reads no section covers (a section covers itself and every field under it)."""
    sections = tuple(sections)
    return sorted(r for r in reads if not any(r == s or r.startswith(s + ".") for s in sections))
