"""Running the real ``trtllm-build``: availability, the subprocess with its log, timing and peak memory.

Only used where TensorRT-LLM 1.0–1.2 is installed and a CUDA GPU is visible; elsewhere the engine stage
writes the CPU twin (:mod:`trtpipe.engine.twin_engine_dir`) and says so.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trtpipe.engine.versions import trtllm_supported
from trtpipe.pipeline.versions import PACKAGES, package_version, query_gpus
from trtpipe.errors import EngineError
from trtpipe.processes import spawn_reader


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not (empty when ok)
    trtllm_version: Optional[str] = None
    gpus: tuple = ()


def availability() -> Availability:
    """Whether a real engine can be built here: TRT-LLM 1.0–1.2 installed, ``trtllm-build`` on PATH, a GPU."""
    ver = package_version(*PACKAGES["tensorrt_llm"])
    gpus = tuple(g["name"] for g in query_gpus()[0])
    if ver is None:
        why = "TensorRT-LLM is not installed" + ("" if gpus else " and no CUDA GPU is visible")
        return Availability(False, why, None, gpus)
    if not trtllm_supported(ver):
        return Availability(
            False, f"TensorRT-LLM {ver} has no trtllm-build TensorRT-engine path (needs 1.0-1.2.x)", ver, gpus
        )
    if shutil.which("trtllm-build") is None:
        return Availability(False, f"TensorRT-LLM {ver} is installed but trtllm-build is not on PATH", ver, gpus)
    if not gpus:
        return Availability(False, "no CUDA GPU is visible (nvidia-smi found none)", ver, gpus)
    return Availability(True, "", ver, gpus)


class _PeakMemory:
    """Samples the build's host RSS (process tree) and GPU memory in use, keeping the maxima."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval = pid, interval
        self.host_bytes = 0
        self.gpu_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                rss = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
                self.host_bytes = max(self.host_bytes, rss)
            except psutil.Error:
                pass
            used = _gpu_used_mib()
            if used is not None:
                self.gpu_mib = max(self.gpu_mib, used)
            self._stop.wait(self.interval)


def _gpu_used_mib() -> Optional[int]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5
        )
        return sum(int(float(x)) for x in out.stdout.split()) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def run_trtllm_build(argv: list[str], out_dir: Path, world_size: int, log: logging.Logger) -> dict:
    """Run ``argv`` (from ``to_argv``) with its output streamed into ``log``; check one engine per rank.

    Returns:
        ``{"seconds", "peak_host_bytes", "peak_gpu_mib", "engines"}``.

    Raises:
        EngineError: non-zero exit (with the last log line) or a missing ``rank{N}.engine``.
    """
    log.info("running: %s", " ".join(argv))
    start = time.monotonic()
    last = ""
    proc = spawn_reader(argv, cwd=out_dir)
    with _PeakMemory(proc.pid) as peak:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                last = line
                log.info("trtllm-build: %s", line)
        rc = proc.wait()
    seconds = time.monotonic() - start
    if rc != 0:
        raise EngineError(f"trtllm-build exited with status {rc} after {seconds:.0f} s: {last}")
    engines = [out_dir / f"rank{r}.engine" for r in range(world_size)]
    missing = [e.name for e in engines if not e.is_file()]
    if missing or not (out_dir / "config.json").is_file():
        raise EngineError(f"trtllm-build finished but {out_dir} lacks {', '.join(missing) or 'config.json'}")
    return {
        "seconds": round(seconds, 1),
        "peak_host_bytes": peak.host_bytes,
        "peak_gpu_mib": peak.gpu_mib,
        "engines": [e.name for e in engines],
    }
