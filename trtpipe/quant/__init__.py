"""Quantization: calibration, FP8 / INT8 / INT4 quantized TensorRT-LLM checkpoints, accuracy against the unquantized.

The layouts it writes and their number formats are in :mod:`trtpipe.checkpoint.quant_layouts` and
:mod:`trtpipe.checkpoint.quant_primitives`; the reference runtime reads the same layouts with its own tables
(:mod:`trtpipe.runtime.linear`), so quantization depends on the runtime (it runs models to calibrate and to
measure accuracy) and the runtime never on quantization. The one exception is :mod:`trtpipe.quant.mxfp4`, a pure
format module (MXFP4 blocks and scales <-> values, importing only torch) with which the converter (and the HF
loader, through it) decodes shipped checkpoints.
"""
