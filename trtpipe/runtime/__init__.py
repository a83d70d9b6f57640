"""The reference runtime: TensorRT-LLM checkpoints (any tp/pp, quantized or not) run on CPU in float32.

It is the oracle for conversion (against transformers), the model calibration runs on, and the
expected output for engine and serving tests.
"""

from trtpipe.runtime.generate import generate, sample
from trtpipe.runtime.linear import LinearSpec, build_linear, register_kv_quant, register_linear_loader
from trtpipe.runtime.loader import load_checkpoint
from trtpipe.runtime.model import BatchKVCache, DecoderLayer, KVCache, ModelArgs, ReferenceModel

__all__ = [
    "BatchKVCache",
    "DecoderLayer",
    "KVCache",
    "LinearSpec",
    "ModelArgs",
    "ReferenceModel",
    "build_linear",
    "generate",
    "load_checkpoint",
    "register_kv_quant",
    "register_linear_loader",
    "sample",
]
