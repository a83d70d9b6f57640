"""trtpipe's completions ingress in front of Dynamo's frontend (issue 38 item 11): a text completion's ids are
trtllm-serve's (``encode(prompt, add_special_tokens=True)``: BOS first), handed to the frontend in
``nvext.token_data``; token-id prompts, chat and everything else pass unchanged. End to end through the real
frontend, router and workers: tests/serving/test_dynamo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtpipe.serving.dynamo_ingress import Encoder, PromptRefused, encode_completion


@pytest.fixture(scope="module")
def encoder(stories_dir):
    return Encoder(stories_dir, max_seq_len=512)


def test_a_text_prompt_gets_trtllm_serves_ids_with_bos(encoder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(encoder.tokenizer.name_or_path))
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "nvext": {"cache_salt": "x"}}
    out = encode_completion(body, encoder, encoder.refuse)
    ids = tok.encode("Once upon a time", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and ids[1:] == tok.encode("Once upon a time", add_special_tokens=False)
    assert out == {**body, "nvext": {"cache_salt": "x", "token_data": ids}}
    assert body["nvext"] == {"cache_salt": "x"}  # the caller's body is not modified
    assert encode_completion({"prompt": ["Once upon a time"]}, encoder, encoder.refuse)["nvext"]["token_data"] == ids


def test_add_special_tokens_false_is_honoured_and_not_forwarded(encoder):
    out = encode_completion({"prompt": "The little dog", "add_special_tokens": False}, encoder, encoder.refuse)
    assert "add_special_tokens" not in out
    assert out["nvext"]["token_data"] == encoder("The little dog", add_special_tokens=False)
    assert out["nvext"]["token_data"][0] != encoder.tokenizer.bos_token_id


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [1, 2, 3]},  # a client's own ids: used as given, as trtllm-serve does
        {"prompt": "x", "nvext": {"token_data": [5, 6]}},  # tokenized upstream already
        {"prompt": ["a", "b"]},  # a batch: the frontend refuses it itself
        {"prompt": "x", "add_special_tokens": "yes"},  # not a bool: the frontend's 4xx
        {"prompt": "x", "nvext": "bad"},
        ["not", "an", "object"],
        {"messages": [{"role": "user", "content": "hi"}]},
    ],
)
def test_everything_else_passes_unchanged(encoder, body):
    assert encode_completion(body, encoder, encoder.refuse) is body


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(encoder):
    calls = []

    def encode(text, add_special_tokens=True):
        calls.append(text)
        return [1]

    text = "a" * (512 * encoder.max_chars_per_token)
    with pytest.raises(PromptRefused, match=r"leaves no room in max_seq_len 512"):
        encode_completion({"prompt": text}, encode, encoder.refuse)
    assert calls == []


DYNAMO_PY = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"
SERVE = r"""
import asyncio, json, sys
from aiohttp import ClientSession, web
from trtpipe.serving.dynamo_ingress import Encoder, make_app

seen = {"bodies": [], "left": 0}

async def upstream(request):  # a stand-in frontend: records bodies, streams until the client leaves
    body = await request.read()
    seen["bodies"].append(json.loads(body))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for i in range(600):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.05)
    except (ConnectionResetError, asyncio.CancelledError):
        seen["left"] += 1
        raise
    return resp

async def main(model):
    up = web.Application()
    up.router.add_route("*", "/{tail:.*}", upstream)
    r1 = web.AppRunner(up, handler_cancellation=True)
    await r1.setup()
    s1 = web.TCPSite(r1, "127.0.0.1", 0)
    await s1.start()
    port1 = r1.addresses[0][1]
    r2 = web.AppRunner(make_app(f"http://127.0.0.1:{port1}", Encoder(model, 512)), handler_cancellation=True)
    await r2.setup()
    await web.TCPSite(r2, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{r2.addresses[0][1]}"
    lines = []
    async with ClientSession() as s:
        for path, body in (("/v1/completions", {"prompt": "Once upon a time", "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            async with s.post(url + path, json=body) as r:
                async for line in r.content:
                    lines.append(line.decode())
                    if len(lines) % 4 == 0:
                        break  # the client leaves mid-stream
    for _ in range(200):  # until the stand-in saw both clients leave (it streams for 30 s otherwise)
        if seen["left"] == 2:
            break
        await asyncio.sleep(0.05)
    print(json.dumps({"bodies": seen["bodies"], "left": seen["left"], "lines": lines}))
    await r2.cleanup()
    await r1.cleanup()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(not DYNAMO_PY.is_file(), reason="Dynamo's venv (aiohttp) is not installed")
def test_the_ingress_streams_through_rewrites_completions_and_passes_a_leaving_client_on(stories_dir):
    """The aiohttp server itself, in Dynamo's venv, in front of a stand-in upstream: the completion arrives with
    token_data (BOS first), chat unchanged, the stream's bytes as sent, and a client that leaves mid-stream closes
    the upstream request (so Dynamo's frontend cancels the worker's)."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [str(DYNAMO_PY), "-c", SERVE, str(stories_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    completion, chat = out["bodies"]
    assert completion["nvext"]["token_data"] == Encoder(stories_dir, 512)("Once upon a time")
    assert completion["nvext"]["token_data"][0] == 1  # stories260k's BOS
    assert chat == {"messages": [{"role": "user", "content": "hi"}]}
    assert out["lines"] == ["data: 0\n", "\n", "data: 1\n", "\n"] * 2
    assert out["left"] == 2
