"""How long a short request through the BLS waits when a long one is already running, against the same short
request alone (same command, same server: a ratio, not a wall time to compare across machines).

    python scripts/bls_head_of_line.py REPO [--long 240] [--short 8] [--rounds 2]

REPO must be a streaming repository (``triton.streaming: true``). Each round, streamed and unstreamed: the short
request alone, then the long one and, 0.15 s later, the short one again. Before the BLS read tensorrt_llm as a
stream for unstreamed requests, the unstreamed short request waited for the whole long answer.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from trtpipe.triton.client import Client, GenerateOptions
from trtpipe.triton.server_process import start_server


def ask(url: str, max_tokens: int, stream: bool) -> float:
    t = time.monotonic()
    with Client(url, model="tensorrt_llm_bls") as c:
        opts = GenerateOptions(max_tokens=max_tokens)
        if stream:
            for _ in c.stream("Once upon a time", opts):
                pass
        else:
            c.generate("Once upon a time", opts)
    return time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--long", type=int, default=240, help="tokens of the long request")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from trtpipe.processes import sigterm_as_interrupt

    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us
    with start_server(args.repo, timeout=240) as server:
        url = server.grpc_url
        for _ in range(args.rounds):
            for stream in (False, True):
                alone = ask(url, args.short, stream)
                took: dict = {}
                long = threading.Thread(target=lambda: took.setdefault("long", ask(url, args.long, stream)))
                long.start()
                time.sleep(0.15)
                behind = ask(url, args.short, stream)
                long.join()
                print(f"{'streamed' if stream else 'unstreamed'}: {args.short} tokens alone {alone:.2f} s, "
                      f"while {args.long} tokens run {behind:.2f} s ({behind / alone:.1f}x; the long one took "
                      f"{took['long']:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
