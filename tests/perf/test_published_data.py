"""The published performance data shipped in trtpipe/perf/data/: readable, and every row's source documented."""

from __future__ import annotations

import math

from trtpipe.perf.published import PUBLISHED_CSV, read_rows


def test_every_published_row_names_a_documented_source():
    rows = read_rows(PUBLISHED_CSV)
    assert len(rows) > 3000
    sources = (PUBLISHED_CSV.parent / "SOURCES.md").read_text()
    undocumented = {
        (r["source_file"], r["commit_or_date"])
        for r in rows
        if f"| `{r['source_file']}` | {r['commit_or_date']} |" not in sources
    }
    assert not undocumented, sorted(undocumented)[:5]
    bad = [i for i, r in enumerate(rows) if not math.isfinite(float(r["value"])) or float(r["value"]) <= 0]
    assert not bad, [rows[i] for i in bad[:3]]
