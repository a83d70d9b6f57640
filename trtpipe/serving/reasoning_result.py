"""What a reasoning parser returns: the ``content`` and ``reasoning_content`` of a text or of a stream's piece."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReasoningResult:
    content: str = ""
    reasoning_content: str = ""
