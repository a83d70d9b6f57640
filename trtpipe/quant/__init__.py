"""Quantization: calibration, FP8 / INT8 / INT4 quantized TensorRT-LLM checkpoints, accuracy against the unquantized.

The layouts it writes and their number formats are in :mod:`trtpipe.checkpoint.quant_layouts` and
:mod:`trtpipe.checkpoint.quant_primitives`; the reference runtime reads the same layouts with its own tables
(:mod:`trtpipe.runtime.linear`), so quantization depends on the runtime (it runs models to calibrate and to
measure accuracy) and the runtime never on quantization. The exceptions are the pure format modules
:mod:`trtpipe.quant.mxfp4` (MXFP4 blocks and scales <-> values, importing only torch), with which the converter
(and the HF loader, through it) decodes shipped checkpoints, and :mod:`trtpipe.quant.dequant` (GPTQ, AutoAWQ,
compressed-tensors, FP8 block and fbgemm weights -> values, importing torch and the error type), with which the HF
loader runs other producers' checkpoints as stored.
"""
