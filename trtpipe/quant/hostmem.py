"""Does a whole float32 model fit in host memory? (``self`` data and the greedy-continuation metric need one.)

Everything else in calibrate / quantize / verify runs one decoder layer at a time. A whole model "fits" when its
float32 size is at most :data:`FIT_FRACTION` of the host's available memory (psutil) at the moment of asking:
the rest is headroom for activations, the tokenizer and whatever else the host is running. No torch import:
the recipe rules call this at validation time.
"""

from __future__ import annotations

from typing import Optional

import psutil

FIT_FRACTION = 0.5


def gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def whole_model_misfit(float32_bytes: int, available: Optional[int] = None) -> Optional[str]:
    """None when a float32 model of this size fits in host memory, else why not (one phrase, sizes in GiB)."""
    avail = psutil.virtual_memory().available if available is None else available
    if float32_bytes <= FIT_FRACTION * avail:
        return None
    return (
        f"the whole model in float32 ({gib(float32_bytes)}) does not fit in host memory "
        f"({gib(avail)} available; at most {FIT_FRACTION:.0%} of it is used for a whole model)"
    )
