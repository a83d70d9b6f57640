"""The completions ingress of ``trtpipe serve --dynamo``: trtllm-serve's prompt encoding in front of Dynamo's frontend.

Why it exists (issue 38 item 11). ``trtllm-serve`` encodes a completion prompt with the tokenizer's special tokens
(NVIDIA/TensorRT-LLM ``tensorrt_llm/serve/openai_protocol.py@0076e93``: ``CompletionRequest.add_special_tokens``
defaults to True, ``ChatCompletionRequest.add_special_tokens`` to False), so a Llama-family tokenizer puts BOS
first. Dynamo 1.6.1's frontend encodes every text prompt without them (ai-dynamo/dynamo
``lib/llm/src/tokenizers/hf.rs@21aeff0``: ``self.tokenizer.encode(input, false)``; measured on the 1.6.1 wheel by
tests/serving/test_dynamo.py), and its TensorRT-LLM worker serves the frontend's ``token_ids`` as they come (ai-
dynamo 1.6.1 ``dynamo/trtllm/request_handlers/handler_base.py``: text-only input is ``request.get("token_ids")``).
So a real Dynamo + TensorRT-LLM deployment answers a completion without BOS: other text than ``trtllm-serve`` for
the same prompt. Upstream's fix for exactly this (ai-dynamo/dynamo#4610, "Include special tokens in Completions API
Requests") was closed without being merged.

A worker cannot add the BOS itself: it does not know whether its tokens came from a text completion, a chat template
(no special tokens, as trtllm-serve) or a client's own token ids (used as given), and the KV-aware router hashes the
frontend's tokens, so a worker that served other tokens than it was routed on would publish blocks the router never
matches. The fix therefore sits before the frontend tokenizes: this ingress takes the public port, passes every
request through to the frontend unchanged, except a ``/v1/completions`` request with a text prompt, whose ids it
computes as trtllm-serve does and hands over in ``nvext.token_data`` (the frontend's own hook for a prompt tokenized
upstream: ai-dynamo/dynamo ``lib/llm/src/preprocessor.rs@0003697`` ``gather_tokens``, "If nvext.token_data is
present, use the pre-computed tokens directly and skip tokenization"; that commit is later than the 1.6.1 tag, whose
``_core.abi3.so`` carries the same ``nvext.token_data`` / ``[SIDECAR-SKIP-TOKENIZE]`` strings, and the end-to-end
test shows the ids arriving). The prompt text stays in the request; router, worker and KV events all see the same
ids, BOS included.

The rewrite (:func:`encode_completion`) is pure and tested in trtpipe's venv; the server runs in Dynamo's venv
(aiohttp is Dynamo's own dependency), started by :class:`trtpipe.app.launch_dynamo.Supervisor`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

log = logging.getLogger("trtpipe.dynamo.ingress")
COMPLETIONS = "/v1/completions"
TOKENIZER_THREADS = 2  # as the OpenAI twin: tokenizing a huge prompt must not take every core
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}


class PromptRefused(ValueError):
    """A completion prompt refused before it is tokenized (answered 400, as the OpenAI twin answers it)."""


def encode_completion(body: Any, encode: Callable[..., list[int]], refuse: Callable[[str], None]) -> Any:
    """``body`` of a ``/v1/completions`` request with its text prompt's ids (trtllm-serve's encoding) in
    ``nvext.token_data``; anything else unchanged: token-id prompts (used as given, as trtllm-serve does), a body
    that already carries ``token_data``, what is not a JSON object (the frontend words its own 4xx).

    ``add_special_tokens`` is trtllm-serve's completions parameter (default True); the frontend does not know it,
    so it is taken out of the body here. A list of one string is sent on as that string (Dynamo tokenizes a batch
    itself, skipping ``token_data``; it serves a batch of one only)."""
    if not isinstance(body, dict):
        return body
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    nvext = body.get("nvext")
    if not isinstance(prompt, str) or (isinstance(nvext, dict) and "token_data" in nvext):
        return body
    if nvext is not None and not isinstance(nvext, dict):
        return body
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        return body
    refuse(prompt)
    ids = encode(prompt, add_special_tokens=special)
    out = {k: v for k, v in body.items() if k != "add_special_tokens"}
    out["prompt"] = prompt
    out["nvext"] = {**(nvext or {}), "token_data": [int(t) for t in ids]}
    return out


class Encoder:
    """The model's tokenizer as trtllm-serve loads it (transformers ``AutoTokenizer``), and the OpenAI twin's bound:
    a prompt of more characters than ``max_seq_len`` x its longest token's characters cannot fit, and is refused
    without being tokenized."""

    def __init__(self, model_dir: Path, max_seq_len: int):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_seq_len = max_seq_len
        self.max_chars_per_token = max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def refuse(self, text: str) -> None:
        least = -(-len(text) // self.max_chars_per_token)
        if least >= self.max_seq_len:
            raise PromptRefused(
                f"the prompt ({len(text)} characters, so at least {least} tokens: this tokenizer's longest token "
                f"has {self.max_chars_per_token} characters) leaves no room in max_seq_len {self.max_seq_len}"
            )


def _headers(headers) -> dict:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def make_app(upstream: str, encoder: Encoder):
    """An aiohttp application passing everything to ``upstream`` (streams as they come), completions rewritten."""
    import aiohttp
    from aiohttp import web

    pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="trtpipe-ingress-tokenize")

    async def on_startup(app):
        # raw bytes both ways (no decompression), no read deadline: a stream lasts as long as the generation
        app["session"] = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_read=None)
        )

    async def on_cleanup(app):
        await app["session"].close()
        pool.shutdown(wait=False, cancel_futures=True)

    async def rewrite(data: bytes) -> bytes:
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return data  # the frontend answers malformed JSON itself
        loop = asyncio.get_running_loop()
        new = await loop.run_in_executor(pool, encode_completion, body, encoder, encoder.refuse)
        return data if new is body else json.dumps(new).encode()

    async def handle(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        if request.method == "POST" and request.path == COMPLETIONS:
            try:
                data = await rewrite(data)
            except PromptRefused as exc:
                error = {"message": str(exc), "type": "invalid_request_error", "param": "prompt", "code": 400}
                return web.json_response({"error": error}, status=400)
        async with request.app["session"].request(
            request.method, upstream + request.path_qs, data=data, headers=_headers(request.headers)
        ) as up:
            response = web.StreamResponse(status=up.status, reason=up.reason, headers=_headers(up.headers))
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main(argv: Optional[list[str]] = None) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(description="trtpipe's completions ingress in front of Dynamo's frontend")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the frontend's URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--model", required=True, type=Path, help="the directory Dynamo reads the tokenizer from")
    p.add_argument("--max-seq-len", required=True, type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = make_app(args.upstream.rstrip("/"), Encoder(args.model, args.max_seq_len))
    log.info("completions ingress on %s:%d -> %s", args.host, args.port, args.upstream)
    # a client that leaves cancels its handler, which closes the upstream request: the frontend then cancels the
    # worker's request, as when the client talks to it directly (aiohttp does not cancel handlers by default)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
