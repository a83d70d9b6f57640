"""Fuzz the served models over HTTP and gRPC (the cases and checks: trtpipe/triton/fuzz.py): wrong dtypes and
shapes, empty and huge tensors, invalid UTF-8, negative/huge/NaN numbers, malformed stop/bad word lists, unknown
inputs and parameters, 1 MB prompts, out-of-vocabulary token ids.

Every case must get an error or a valid answer; the server must stay up; a valid request afterwards (and every
``--check-every`` cases) must still give the right answer. Run against a repository (a server is started on
127.0.0.1 and stopped at the end)::

    python scripts/fuzz_serving.py REPO [--seed 0] [--limit N]

Prints one JSON summary (cases per model and protocol, outcomes) and exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trtpipe.triton import fuzz
from trtpipe.processes import sigterm_as_interrupt
from trtpipe.triton.server_process import start_server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="cases (each sent over HTTP and gRPC); default: all")
    ap.add_argument("--check-every", type=int, default=50)
    args = ap.parse_args()
    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us
    with start_server(args.repo, timeout=300) as server:
        summary = fuzz.run(server.http_url, server.grpc_url, args.limit, args.seed, args.check_every, server.alive)
    print(json.dumps(summary, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
