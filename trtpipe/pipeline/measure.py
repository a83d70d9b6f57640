"""Per-stage peak resident memory: this process plus its children.

``getrusage`` gives exact high-water marks, but for the whole process life, not for one stage. So:
  * self: if ``ru_maxrss`` rose during the stage, the new mark is the stage's exact peak; otherwise the stage
    stayed below an earlier peak and a sampler thread's maximum (every 50 ms) is the best measure there is.
  * children: the sampled maximum of the summed RSS of all live descendants (psutil, recursive).
    ``RUSAGE_CHILDREN`` is not used: a child's mark includes the parent's pages it shares between fork and
    exec, so a 10 MB ``echo`` forked from a 500 MB build reads as 500 MB. Children living less than one
    sampling interval can be missed.
Both are in bytes. Without psutil only this process is measured and ``children_bytes`` is None.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from typing import Optional

try:
    import psutil
except ImportError:  # psutil is optional: without it only this process is measured
    psutil = None

_KB = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _maxrss(who: int) -> int:
    return resource.getrusage(who).ru_maxrss * _KB


def _rss_now() -> tuple[int, int]:
    """(rss of this process, summed rss of its live descendants) in bytes."""
    if psutil is None:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE, 0
    me = psutil.Process()
    children = 0
    for child in me.children(recursive=True):
        try:
            children += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return me.memory_info().rss, children


class PeakRss:
    """``with PeakRss() as peak: ...`` then ``peak.self_bytes``, ``peak.children_bytes``, ``peak.total_bytes``."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.self_bytes = 0
        self.children_bytes: Optional[int] = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def total_bytes(self) -> int:
        return self.self_bytes + (self.children_bytes or 0)

    def _sample(self) -> None:
        mine, kids = _rss_now()
        self._sampled_self = max(self._sampled_self, mine)
        self._sampled_kids = max(self._sampled_kids, kids)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # a child exiting mid-walk; the next sample sees the rest
                continue

    def __enter__(self) -> "PeakRss":
        self._self_before = _maxrss(resource.RUSAGE_SELF)
        self._sampled_self = self._sampled_kids = 0
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="trtpipe-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self_after = _maxrss(resource.RUSAGE_SELF)
        self.self_bytes = self_after if self_after > self._self_before else self._sampled_self
        self.children_bytes = self._sampled_kids if psutil is not None else None
