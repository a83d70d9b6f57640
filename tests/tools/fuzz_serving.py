"""Fuzz a served model. A Triton repository (cases and checks: tests/tools/triton_fuzz.py) over HTTP and gRPC: wrong
dtypes and shapes, empty and huge tensors, invalid UTF-8, negative/huge/NaN numbers, malformed stop/bad word lists,
unknown inputs and parameters, 1 MB prompts, out-of-vocabulary token ids. An HF model directory or a
``target: llmapi`` recipe (tests/tools/openai_fuzz.py) on the OpenAI twin: every field of completions and chat,
streaming and not, broken JSON, bad UTF-8, 1 MB prompts, unknown fields, clients leaving mid-stream.

Every case must get an error (OpenAI-shaped on the twin) or a valid answer; the server must stay up; a valid
request afterwards must still give the right answer (Triton: every ``--check-every`` cases; the twin: after each
case). The server is started on 127.0.0.1 and stopped at the end::

    python tests/tools/fuzz_serving.py TARGET [--seed 0] [--limit N] [--expect TEXT] [--chat-template FILE]

Prints one JSON summary (cases, outcomes, failures) and exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trtpipe.processes import sigterm_as_interrupt


def fuzz_triton(args) -> dict:
    import triton_fuzz as fuzz  # beside this file (python puts a script's folder on sys.path)
    from trtpipe.triton.server_process import start_server

    with start_server(args.target, timeout=300) as server:
        return fuzz.run(server.http_url, server.grpc_url, args.limit, args.seed, args.check_every, server.alive)


def fuzz_openai(args) -> dict:
    import openai_fuzz
    from trtpipe.app.launch_openai import resolve_openai_target, start_detached

    target = resolve_openai_target(args.target, args.set, port=args.port, chat_template=args.chat_template)
    server = start_detached(target, args.set, timeout=300)
    try:
        return openai_fuzz.run(server.http_url, target.name, args.expect, args.limit, args.seed, server.alive)
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="a Triton repository, an HF model directory or an llmapi recipe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="cases (Triton: each over HTTP and gRPC); default: all")
    ap.add_argument("--check-every", type=int, default=50, help="Triton: cases between two valid requests")
    ap.add_argument(
        "--expect",
        default=None,
        help="OpenAI twin: the valid greedy request's text (default: the server's first answer)",
    )
    ap.add_argument("--set", action="append", default=[], help="recipe override (llmapi recipe)")
    ap.add_argument("--port", type=int, default=None, help="OpenAI twin port (default: the recipe's)")
    ap.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="OpenAI twin: a chat template for a tokenizer without one (the chat cases need it)",
    )
    args = ap.parse_args()
    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us
    from trtpipe.app.launch_openai import is_openai_target

    summary = fuzz_openai(args) if is_openai_target(args.target, args.set) else fuzz_triton(args)
    print(json.dumps(summary, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
