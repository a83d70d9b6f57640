"""An aiohttp app (the OpenAI twin's) served on loopback from a thread of this process.

For callers that drive the server from the same process: ``trtpipe eval --harness`` (lm-evaluation-harness
against the twin) and the tests. The socket is bound to port 0 and handed to aiohttp as is, so no free port is
guessed: nothing else can take the port between a probe and the bind.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager
from typing import Iterator

from trtpipe.errors import ServingError
from trtpipe.extras import require


@contextmanager
def serve_in_thread(app, what: str = "the OpenAI twin") -> Iterator[str]:
    """Yield ``http://127.0.0.1:PORT`` while ``app`` serves from a daemon thread; cleaned up (the app's shutdown
    hooks run: the twin stops its executor) when the block ends. A server that cannot start raises
    :class:`ServingError` naming ``what``."""
    web = require("aiohttp.web", "serving an aiohttp app in a thread")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop, runner = asyncio.new_event_loop(), web.AppRunner(app)
    started, failed = threading.Event(), []

    def run():
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.SockSite(runner, sock).start())
        except Exception as exc:  # noqa: BLE001 - reported to the caller below
            failed.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="trtpipe-thread-server", daemon=True)
    thread.start()
    started.wait()
    if failed:
        sock.close()
        raise ServingError(f"{what} did not start: {failed[0]}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        sock.close()
