"""Poison sampling values through the OpenAI twin over real HTTP (issue 38 item 1): top_p 0, top_p 1e-300 and
temperature 1e-40 sent in the same step as 6 innocent requests; every innocent is answered with its text alone
(each poison too: it samples greedily, as TensorRT-LLM maps those values). The step is held by the test until every
request is queued, so all of them share a step whatever the machine's speed (no timing is asserted)."""

from __future__ import annotations

import json
import threading

import pytest
from openai_helpers import serve_in_thread
from test_openai_overload import _Gated, _post, _served, _wait

from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp")]

INNOCENTS = ["Once upon a time", "The cat", "Lily and Ben", "One day", "Tom was", "She saw a"]
POISON = [{"temperature": 1, "top_p": 0}, {"temperature": 1, "top_p": 1e-300}, {"temperature": 1e-40}]


def test_poison_values_beside_six_innocents(stories_fp16_export, fp16_greedy_text):
    from trtpipe.serving.executor import Executor

    served, app = _served(stories_fp16_export, max_batch_size=16)
    model = served.executor.core.engine.model
    served.executor.shutdown()
    served.executor = Executor(served.config, engine := _Gated(model))
    core = served.executor.core
    try:
        with serve_in_thread(app) as url:
            results, threads = {}, []

            def start(name, body):
                t = threading.Thread(target=lambda: results.__setitem__(name, _post(url, body)))
                t.start()
                threads.append(t)

            start("hold", {"prompt": "Once", "max_tokens": 8, "temperature": 0})
            assert engine.at_gate.wait(300)  # the first request is inside its second step: the rest queue
            for i, poison in enumerate(POISON):
                start(f"poison{i}", {"prompt": INNOCENTS[0], "max_tokens": 4, **poison})
            for i, prompt in enumerate(INNOCENTS):
                start(f"innocent{i}", {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            _wait(lambda: len(core.queue) == len(POISON) + len(INNOCENTS), "every request queued")
            engine.gate.set()  # one step admits them all: the poison rows are sampled beside the innocents
            for t in threads:
                t.join(300)
        texts = {}
        for name, (status, _, body) in results.items():
            assert status == 200, (name, body[:300])
            texts[name] = json.loads(body)["choices"][0]["text"]
        assert [texts[f"innocent{i}"] for i in range(6)] == [fp16_greedy_text(p, 4) for p in INNOCENTS]
        assert [texts[f"poison{i}"] for i in range(3)] == [fp16_greedy_text(INNOCENTS[0], 4)] * 3
    finally:
        served.shutdown()
