"""The OpenAI twin's aiohttp app served on 127.0.0.1 from a thread of the test process (a uniquely named module)."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager


@contextmanager
def serve_in_thread(app):
    """Yield the base URL (``http://127.0.0.1:PORT``) while ``app`` serves on a free loopback port; stop it after."""
    from aiohttp import web

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop, runner, started = asyncio.new_event_loop(), web.AppRunner(app), threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
