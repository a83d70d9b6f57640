"""docs/reference/prequantized.md's format x target table: every row is what detection says for that format's
config (the action per target, and the refusal text word for word), and every case here has its row."""

from __future__ import annotations

from pathlib import Path

import pytest

from table_cases import CASES
from trtpipe.quant.imported.detect import detect_config

DOC = Path(__file__).resolve().parents[3] / "docs" / "reference" / "prequantized.md"


def _rows() -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("format",) and not cells[0].startswith("-"):
            rows[cells[0]] = (cells[1].strip("`"), cells[2], cells[3])
    return rows


def _cell(action) -> str:
    return action.kind + (f": {action.why}" if action.kind == "refused" else "")


def test_every_case_has_a_row_and_every_row_a_case():
    assert set(_rows()) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_row(name):
    qc, hq = CASES[name]
    fmt = detect_config(Path("model"), {"quantization_config": qc} if qc else {}, hq)
    algo, engine, llmapi = _rows()[name]
    assert (fmt.quant_algo or "-", _cell(fmt.engine), _cell(fmt.llmapi)) == (algo, engine, llmapi)
