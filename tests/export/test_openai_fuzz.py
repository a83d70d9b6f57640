"""A fixed sample of the OpenAI twin's fuzz cases (tests/tools/openai_fuzz.py) over real HTTP: completions and
chat, streaming and not, with wrong types, huge/negative/non-finite numbers, unknown fields, broken JSON, bad UTF-8,
1 MB prompts and clients leaving mid-stream. Every case gets an OpenAI-shaped 4xx or a valid answer, and after each
one a greedy request answers transformers' greedy text. The whole campaign: python tests/tools/fuzz_serving.py MODEL."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai_helpers import serve_in_thread

from tools import openai_fuzz
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

TEMPLATE = (Path(__file__).parent / "data" / "chat_template.jinja").read_text()


def test_fuzzed_requests_get_an_openai_error_or_an_answer(stories_fp16_export, fp16_greedy_text):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    expected = fp16_greedy_text(openai_fuzz.PROMPT, openai_fuzz.CHECK_TOKENS)
    served = ServedModel(stories_fp16_export, "fuzzed", chat_template=TEMPLATE)
    try:
        with serve_in_thread(OpenAIServer(served).app) as url:
            summary = openai_fuzz.run(
                url, "fuzzed", expected=expected, limit=90, seed=3, alive=lambda: served.executor.healthy
            )
    finally:
        served.shutdown()
    print(summary)
    assert summary["failures"] == []
    outcomes = summary["outcomes"]
    assert sum(outcomes.values()) == summary["cases"] == 90
    for ep in ("completions", "chat"):  # both endpoints, both modes, answers and refusals all seen
        for mode in ("plain", "stream"):
            assert outcomes.get(f"{ep} {mode} answer", 0) > 0 and outcomes.get(f"{ep} {mode} 400", 0) > 0
