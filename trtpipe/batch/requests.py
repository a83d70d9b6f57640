"""Read an OpenAI Batch input file: one JSON object per line, ``{"custom_id", "method", "url", "body"}``.

The format is OpenAI's ``BatchRequestInput`` (openai/openai-openapi, ``openapi.yaml``): ``custom_id`` unique in
the file, ``method`` ``POST``, ``url`` an endpoint path, ``body`` the request. Every problem names the file and
line; a duplicate ``custom_id`` names the line it first appeared on too, since resuming relies on the ids being
unique. Blank lines are skipped (an editor's trailing newline is not a request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtpipe.errors import TrtpipeError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")  # what trtllm-serve (and the twin) answer
MAX_PROBLEMS_SHOWN = 5


class BatchError(TrtpipeError):
    """A batch input, output or state file that cannot be used, or a job that cannot go on (one line each)."""

    exit_code = 2


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


def _check(obj: Any) -> str | None:
    """What is wrong with one parsed line (one phrase), or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, found a {type(obj).__name__}"
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return f"unknown key {unknown[0]!r} (expected custom_id, method, url, body)"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "custom_id: expected a non-empty string"
    if obj.get("method") != "POST":
        return f"method: expected 'POST', got {obj.get('method')!r}"
    if obj.get("url") not in ENDPOINTS:
        return f"url: expected one of {', '.join(ENDPOINTS)}, got {obj.get('url')!r}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "body: expected a JSON object (the request)"
    if body.get("stream"):
        return "body.stream: a batch request cannot stream (drop it)"
    return None


def read_requests(path: Path) -> list[BatchRequest]:
    """Every request of ``path`` in file order; BatchError listing the first problems (file:line) otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BatchError(f"{path}: cannot read: {exc.strerror or exc}") from None
    problems: list[str] = []
    seen: dict[str, int] = {}
    out: list[BatchRequest] = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{path}:{n}: invalid JSON: {getattr(exc, 'msg', exc)}")
            continue
        why = _check(obj)
        if why is not None:
            problems.append(f"{path}:{n}: {why}")
            continue
        cid = obj["custom_id"]
        if cid in seen:
            problems.append(f"{path}:{n}: duplicate custom_id {cid!r} (first on line {seen[cid]})")
            continue
        seen[cid] = n
        out.append(BatchRequest(n, cid, obj["url"], obj["body"]))
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        raise BatchError("\n".join(problems[:MAX_PROBLEMS_SHOWN] + ([f"... and {more} more"] if more > 0 else [])))
    if not out:
        raise BatchError(f"{path}: no requests (one JSON object per line)")
    return out
