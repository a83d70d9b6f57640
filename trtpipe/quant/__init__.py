"""Quantization: calibration, FP8 / INT8 / INT4 quantized TensorRT-LLM checkpoints, accuracy against the unquantized.

The layouts it writes are in :mod:`trtpipe.checkpoint.quant_layouts`; the schemes (one row per algorithm) and the
number formats (quantize / dequantize, int4 and FP4 packing, MXFP4, other producers' weights) are in
:mod:`trtpipe.formats`, the bottom of the package, so the runtime, the converter and this package read the same
functions. Quantization depends on the runtime (it runs models to calibrate and to measure accuracy), never the
reverse.
"""
