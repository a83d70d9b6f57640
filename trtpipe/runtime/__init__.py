"""The reference runtime: TensorRT-LLM checkpoints (any tp/pp, quantized or not) run on CPU in float32.

It is the oracle for conversion (against transformers), the model calibration runs on, and the
expected output for engine and serving tests.
"""

from trtpipe.runtime.generate import generate, sample
from trtpipe.runtime.linear import KV_QUANT, LINEAR_LOADERS, LinearSpec, build_linear
from trtpipe.runtime.loader import load_checkpoint
from trtpipe.runtime.model import BatchKVCache, DecoderLayer, KVCache, ModelArgs, ReferenceModel

__all__ = [
    "BatchKVCache",
    "DecoderLayer",
    "KVCache",
    "KV_QUANT",
    "LINEAR_LOADERS",
    "LinearSpec",
    "ModelArgs",
    "ReferenceModel",
    "build_linear",
    "generate",
    "load_checkpoint",
    "sample",
]
