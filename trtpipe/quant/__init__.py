"""Quantization: calibration, FP8 / INT8 / INT4 layouts for TensorRT-LLM, the quantized reference, accuracy.

Importing the package registers the quantized-linear and KV-cache handlers of the reference runtime.
"""

from trtpipe.quant import reference as _reference  # noqa: F401  (registers runtime handlers)
