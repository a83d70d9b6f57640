"""The OpenAI twin's aiohttp app served on 127.0.0.1 from a thread of the test process, and the model it serves in
the tests (a uniquely named module)."""

from __future__ import annotations

import asyncio
import socket
import threading
from contextlib import contextmanager
from pathlib import Path


def fp16_export(stories_dir: Path, root: Path) -> Path:
    """stories260k as the llmapi export writes it in float16 (no quantization): the HF directory ``root/hf``."""
    from trtpipe.checkpoint.convert import convert
    from trtpipe.export.unified import export_unified

    base = convert(stories_dir, root / "base", tp=1, dtype="float16")
    out = root / "hf"
    out.mkdir()
    export_unified(
        base, stories_dir, None, out, algo="none", kv_cache="none", group_size=128, alpha=0.5, exclude=["*lm_head"]
    )
    return out


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
