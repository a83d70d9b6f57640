"""A streamed answer never shows the start of a stop string (issue 38 item 7): text that may still become a stop
string is held back until the next tokens decide, so the streamed pieces join to exactly the non-streamed text for
stop strings that span several tokens (before: stop " girl named" ended the stream with " girl")."""

from __future__ import annotations

import json

import pytest
from openai_helpers import serve_in_thread
from test_openai_overload import _post, _served

from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

PROMPT = "Once upon a time"


def _streamed(url: str, body: dict) -> str:
    status, _, raw = _post(url, {**body, "stream": True})
    assert status == 200, raw[:300]
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


@pytest.mark.parametrize("stop", [" girl named", " little girl", "there was", ", th"])
def test_streamed_text_equals_the_text_for_stop_strings_spanning_tokens(stories_fp16_export, fp16_greedy_text, stop):
    assert stop in fp16_greedy_text(PROMPT, 16)  # the stop string is met within the request's tokens
    served, app = _served(stories_fp16_export)
    try:
        with serve_in_thread(app) as url:
            body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stop}
            status, _, raw = _post(url, body)
            assert status == 200, raw[:300]
            text = json.loads(raw)["choices"][0]["text"]
            assert text == fp16_greedy_text(PROMPT, 16).split(stop)[0]
            assert _streamed(url, body) == text
    finally:
        served.shutdown()
