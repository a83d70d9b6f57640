"""Number formats at the bottom of the package: the quantization scheme table and the pure tensor functions.

:mod:`.schemes` holds one row per quantization algorithm (names per format, bytes per weight, group sizes, data
needs, minimum SM, MoE support, performance precision); the recipe enum, the rules, the planner, the writers, the
importers and the predictor look facts up there. :mod:`.primitives` (quantize / dequantize, int4 and NVFP4
packing), :mod:`.mxfp4`, :mod:`.dequant` (other producers' weights) and :mod:`.gpus` (the GPU catalog the SM
floors are checked against) sit beside it. Nothing here imports another trtpipe package but :mod:`trtpipe.errors`.
"""
