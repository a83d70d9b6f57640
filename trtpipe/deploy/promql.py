"""The metric names a PromQL expression reads, so a test can hold the rules and dashboard to what servers export.

A lexical pass, not a parser (Prometheus's own parser checks syntax: ``promtool check rules`` and the query API):
string literals, label matchers ``{...}``, ranges ``[...]`` and ``by``/``without``/``on``/``ignoring`` label
lists are dropped; identifiers followed by ``(`` are functions or aggregations; keywords and numbers go.
"""

from __future__ import annotations

import re

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*(?=\s*(\()?)")


def metric_names(expr: str) -> set[str]:
    """Metric (and recording-rule) names in ``expr``."""
    text = _STRINGS.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if m.group(1) or word.lower() in KEYWORDS:
            continue
        if m.start() and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):  # 1e-9, 5m
            continue
        names.add(word)
    return names


def exported_names(exposition: str) -> set[str]:
    """Sample names in a Prometheus text exposition (``name{...} value`` lines)."""
    return {
        re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }
