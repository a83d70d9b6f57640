"""The batch input file: OpenAI Batch lines accepted, every bad line named by file:line, duplicates by both lines;
through the CLI, a bad input exits 2 with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtpipe.batch.requests import BatchError, read_requests

REPO = Path(__file__).resolve().parents[2]


def line(cid="a", url="/v1/completions", body=None, **extra) -> str:
    return json.dumps(
        {
            "custom_id": cid,
            "method": "POST",
            "url": url,
            "body": {"prompt": "x", "max_tokens": 2} if body is None else body,
            **extra,
        }
    )


def test_requests_in_file_order_blank_lines_skipped(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text(line("a") + "\n\n" + line("b", "/v1/chat/completions", {"messages": []}) + "\n")
    got = read_requests(p)
    assert [(r.line, r.custom_id, r.url) for r in got] == [
        (1, "a", "/v1/completions"),
        (3, "b", "/v1/chat/completions"),
    ]
    assert got[1].body == {"messages": []}


def test_duplicate_custom_id_names_both_lines(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join([line("a"), line("b"), line("a")]) + "\n")
    with pytest.raises(BatchError) as e:
        read_requests(p)
    assert str(e.value) == f"{p}:3: duplicate custom_id 'a' (first on line 1)"


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, found a list"),
        (line(""), "custom_id: expected a non-empty string"),
        (
            json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
            "method: expected 'POST', got 'GET'",
        ),
        (
            line(url="/v1/embeddings"),
            "url: expected one of /v1/completions, /v1/chat/completions, got '/v1/embeddings'",
        ),
        (line(body=[1]), "body: expected a JSON object"),
        (line(body={"prompt": "x", "stream": True}), "body.stream: a batch request cannot stream"),
        (line(extra_key=1), "unknown key 'extra_key'"),
    ],
)
def test_each_bad_line_is_named(tmp_path, text, message):
    p = tmp_path / "in.jsonl"
    p.write_text(line("ok") + "\n" + text + "\n")
    with pytest.raises(BatchError) as e:
        read_requests(p)
    assert str(e.value).startswith(f"{p}:2: ") and message in str(e.value)


def test_many_problems_listed_then_counted(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(["{"] * 8) + "\n")
    lines = str(pytest.raises(BatchError, read_requests, p).value).splitlines()
    assert [x.split(":")[1] for x in lines[:5]] == ["1", "2", "3", "4", "5"] and lines[5] == "... and 3 more"


def test_empty_or_missing_input(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    assert "no requests" in str(pytest.raises(BatchError, read_requests, tmp_path / "empty.jsonl").value)
    assert "cannot read" in str(pytest.raises(BatchError, read_requests, tmp_path / "none.jsonl").value)


def test_cli_refuses_a_duplicate_before_sending_anything(tmp_path):
    p, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    p.write_text("\n".join([line("a"), line("a")]) + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", "batch", "http://127.0.0.1:9", "-i", str(p), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == f"{p}:2: duplicate custom_id 'a' (first on line 1)"
    assert not out.exists() and not (tmp_path / "out.errors.jsonl").exists()


@pytest.mark.parametrize("value", ["2", "-0.1", "high"])
def test_cli_refuses_a_priority_outside_0_1(tmp_path, value):
    p = tmp_path / "in.jsonl"
    p.write_text(line("a") + "\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trtpipe.cli",
            "batch",
            "http://127.0.0.1:9",
            "-i",
            str(p),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--priority",
            value,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 2 and "--priority" in r.stderr and "expected a number in [0, 1] or 'none'" in r.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_refuses_the_input_as_output_and_leaves_it_whole(tmp_path):
    p = tmp_path / "in.jsonl"
    text = "\n".join([line("a"), line("b")])  # no final newline
    p.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", "batch", "http://127.0.0.1:9", "-i", str(p), "-o", str(p)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == f"{p}: the output file is the input file ({p}); give each its own file"
    assert p.read_text() == text and sorted(x.name for x in tmp_path.iterdir()) == ["in.jsonl"]
