"""Quantization: calibration, FP8 / INT8 / INT4 layouts for TensorRT-LLM, the quantized reference, accuracy.

The reference runtime finds its quantized-linear and KV-cache handlers by importing this package
(``trtpipe.runtime.linear._lookup``), so they are registered here, but only once torch is loaded: recipe
validation imports ``trtpipe.quant.rules`` and must stay fast (no torch). Every module here that runs
quantized checkpoints imports :mod:`trtpipe.quant.reference` itself, so the order never matters for them.
"""

import sys

if "torch" in sys.modules:
    from trtpipe.quant import reference as _reference  # noqa: F401  (registers the runtime handlers)
