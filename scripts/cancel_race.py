"""Cancel streams on a served streaming repository until the server stops answering (or N cancels), to show
tritonserver 2.51's cancel deadlock and that cancelling while the model has nothing to send avoids it.

    python scripts/cancel_race.py REPO [--cancels 800] [--pattern streamed|unstreamed] [--delay-ms 3]

``streamed``: each stream is cancelled after its first piece, while the model keeps sending (what most clients do).
``unstreamed``: an unstreamed request is cancelled 50 ms in, mid-generation, when the model has nothing to send.
Both go straight to ``tensorrt_llm``, 4 clients at a time. ``--delay-ms`` sets Triton's own test knob
``TRITONSERVER_DELAY_GRPC_RESPONSE``, which widens the race window (0: the server as shipped). A client that gets
no response within 60 s means the server hangs: the script then writes every server thread's stack (gdb) next
to the server log, and exits 1. It prints tritonserver's RSS before and after the cancels.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import tritonclient.grpc as grpcclient

from trtpipe.triton.client import infer_inputs
from trtpipe.triton.server_process import start_server

PROMPT_IDS = [1, 403, 407, 261, 378]  # "Once upon a time" in stories260k's tokenizer; any ids work for the twin


def llm_inputs(max_tokens: int, streaming: bool) -> list:
    rows = [("input_ids", np.array([PROMPT_IDS], np.int32), "INT32"),
            ("input_lengths", np.array([[len(PROMPT_IDS)]], np.int32), "INT32"),
            ("request_output_len", np.array([[max_tokens]], np.int32), "INT32"),
            ("streaming", np.array([[streaming]], bool), "BOOL"), ("end_id", np.array([[-1]], np.int32), "INT32")]
    return infer_inputs(grpcclient, rows)


def cancel_one(url: str, pattern: str, i: int) -> None:
    """One request, cancelled; raises TimeoutError when the server sends nothing for 60 s."""
    raw = grpcclient.InferenceServerClient(url)
    first = threading.Event()
    raw.start_stream(callback=lambda result, error: first.set())
    try:
        raw.async_stream_infer("tensorrt_llm", llm_inputs(200, pattern == "streamed"), request_id=f"r{i}")
        if pattern == "streamed":
            if not first.wait(60):
                raise TimeoutError(f"request {i}: no first piece in 60 s")
        else:
            time.sleep(0.05)
    finally:
        raw.stop_stream(cancel_requests=True)
        raw.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--cancels", type=int, default=800)
    ap.add_argument("--pattern", choices=("streamed", "unstreamed"), default="streamed")
    ap.add_argument("--delay-ms", type=int, default=3)
    args = ap.parse_args()
    from trtpipe.processes import sigterm_as_interrupt

    sigterm_as_interrupt()  # a kill stops the server too: it runs in its own session and would outlive us
    if args.delay_ms:
        os.environ["TRITONSERVER_DELAY_GRPC_RESPONSE"] = str(args.delay_ms)
    with start_server(args.repo, timeout=240) as server:
        rss = lambda: psutil.Process(server.pid).memory_info().rss / 2**20  # noqa: E731
        before, t0 = rss(), time.monotonic()
        for start in range(0, args.cancels, 4):
            errors: list = []

            def run(k):
                try:
                    cancel_one(server.grpc_url, args.pattern, start + k)
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(70)
            if errors or any(t.is_alive() for t in threads):
                stacks = Path(server.log).with_suffix(".stacks.txt")
                if shutil.which("gdb"):
                    with open(stacks, "w") as fh:
                        subprocess.run(["gdb", "-p", str(server.pid), "-batch", "-ex", "thread apply all bt"],
                                       stdout=fh, stderr=subprocess.STDOUT, timeout=120)
                print(f"{args.pattern}: the server stopped answering after {start} cancels "
                      f"({time.monotonic() - t0:.0f} s): {errors[0] if errors else 'a client hangs'}; "
                      f"alive={server.alive()}; server stacks: {stacks if shutil.which('gdb') else 'no gdb'}")
                return 1
        time.sleep(3)
        print(f"{args.pattern}: {args.cancels} cancels in {time.monotonic() - t0:.0f} s, the server answered "
              f"throughout; tritonserver RSS {before:.1f} -> {rss():.1f} MB (TRITONSERVER_DELAY_GRPC_RESPONSE="
              f"{args.delay_ms or 'unset'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
