"""Every JSON file trtpipe reads goes through ``trtpipe/jsonfile.py`` (issue 38 item 9): a FIFO or device where a
file is expected is refused before it is opened (one line, no hang), and a NaN or infinite number is refused.

The sites are found, not listed: any ``json.load(...)`` or ``json.loads(<x>.read_text() / .read_bytes())`` outside
``jsonfile.py`` is a file read that skips the checks. JSON Lines (``json.loads(line)``) and HTTP bodies are not files
read whole and are left alone."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trtpipe.errors import TrtpipeError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trtpipe"
FILE_READS = {"read_text", "read_bytes"}


def _is_json(func: ast.expr, name: str) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == name and getattr(func.value, "id", None) == "json"


def direct_json_file_reads() -> list[str]:
    """``path:line`` of every whole-file JSON read in trtpipe/ that bypasses jsonfile.py."""
    found = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == PACKAGE / "jsonfile.py":
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.Call):
                continue
            if _is_json(node.func, "load"):
                found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
            elif _is_json(node.func, "loads") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in FILE_READS:
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_json_file_is_read_outside_jsonfile():
    assert direct_json_file_reads() == []


def _finishes(fn, timeout_s: float = 20.0):
    """``fn()``'s result or exception; fails (instead of hanging the suite) when it blocks on the FIFO."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "blocked reading a FIFO"
    return out


@pytest.fixture()
def model_dir_with_fifo(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / "config.json")
    os.mkfifo(d / "generation_config.json")
    return d


def test_fifo_configs_are_refused_at_the_former_sites(model_dir_with_fifo):
    from trtpipe.processes import read_state
    from trtpipe.runtime.text import end_id
    from trtpipe.stages.quant import quant_meta
    from trtpipe.triton.repo import EngineInfo

    d = model_dir_with_fifo
    for call in (lambda: end_id(d, None), lambda: quant_meta(d), lambda: EngineInfo.read(d)):
        out = _finishes(call)
        err = out.get("error")
        assert isinstance(err, TrtpipeError), out
        assert "is a FIFO, not a regular file" in str(err) and "\n" not in str(err)
    assert _finishes(lambda: read_state(d / "config.json")) == {"value": None}  # a state file: unreadable = absent


def test_nan_in_a_read_config_is_refused(tmp_path):
    from trtpipe.runtime.text import end_id

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": NaN}')
    with pytest.raises(TrtpipeError, match=r"generation_config.json: key 'temperature': NaN is not a finite"):
        end_id(tmp_path, None)


def test_cli_with_a_fifo_model_config_exits_with_one_line(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from trtpipe.cli import main; main()",
            "plan",
            "recipes/stories-fp16.yaml",
            "--model-config",
            str(fifo),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(fifo) in lines[0] and "FIFO" in lines[0], proc.stderr
