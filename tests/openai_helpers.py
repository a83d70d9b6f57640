"""The OpenAI twin's aiohttp app served on 127.0.0.1 from a thread of the test process, and the model it serves in
the tests (a uniquely named module)."""

from __future__ import annotations

from pathlib import Path

from trtpipe.serving import thread_server


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


serve_in_thread = thread_server.serve_in_thread  # the app on 127.0.0.1 (port 0, no bind-then-close race)
