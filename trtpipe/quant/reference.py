"""Reference-runtime handlers for quantized checkpoints, registered in ``trtpipe.runtime.linear``.

Each loader dequantizes the stored weight once and fake-quantizes activations the way the TensorRT-LLM kernel
sees them: FP8 / INT8 static per-tensor input scales, the SmoothQuant / AWQ pre-quant scale multiplied into the
input first (``x * pqs``), W4A8's group scale divided by ``weights_scaling_factor_2`` in fp16 as the builder
does. KV-cache handlers round-trip keys and values through FP8 / INT8 with the layer's scale.
"""

from __future__ import annotations

import torch
from torch import nn

from trtpipe.errors import CheckpointError
from trtpipe.checkpoint.quant_layouts import BY_QUANT_ALGO
from trtpipe.checkpoint.quant_primitives import FORMATS, dequantize, fake_quant, unpack_int4_rows
from trtpipe.runtime.linear import LinearSpec, register_kv_quant, register_linear_loader


class QuantLinear(nn.Module):
    """``y = Qa(x * pqs) @ W_deq^T``; every piece optional."""

    def __init__(self, weight: torch.Tensor, pqs=None, act_scale=None, act_fmt=None, bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)  # [out, in] dequantized
        self.pqs = None if pqs is None else pqs.float()
        self.act_scale = None if act_scale is None else act_scale.float()
        self.act_fmt = act_fmt
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pqs is not None:
            x = x * self.pqs
        if self.act_fmt is not None:
            x = fake_quant(x, self.act_scale, self.act_fmt)
        return nn.functional.linear(x, self.weight, self.bias)


def _need(tensors: dict, key: str, spec: LinearSpec) -> torch.Tensor:
    if key not in tensors:
        raise CheckpointError(f"checkpoint: tensor '{spec.name}.{key}' is missing for quant_algo {spec.quant_algo}")
    return tensors[key]


def dequantize_weight(tensors: dict, spec: LinearSpec) -> torch.Tensor:
    """The float32 ``[out, in]`` weight a quantized linear multiplies by (pre-quant scale not folded in)."""
    algo = BY_QUANT_ALGO[spec.quant_algo]
    q, wsf = _need(tensors, "weight", spec), _need(tensors, "weights_scaling_factor", spec).float()
    if algo.weight_fmt == "int4":
        q = unpack_int4_rows(q)
        g = q.shape[1] // wsf.shape[1]
        if "weights_scaling_factor_2" in tensors:  # builder: wsf /= wsf2 in fp16, alpha = act_sf * wsf2
            wsf2 = tensors["weights_scaling_factor_2"].float()
            wsf = (wsf / wsf2).half().float() * wsf2
        return dequantize(q, wsf, "int4", g)
    want = FORMATS[algo.weight_fmt].dtype
    if q.dtype == torch.int8 and want == torch.float8_e4m3fn:
        q = q.view(want)  # TRT-LLM also accepts FP8 weights stored as int8 bit patterns
    if q.dtype != want:
        raise CheckpointError(f"checkpoint: '{spec.name}.weight' is {q.dtype}, {spec.quant_algo} needs {want}")
    return dequantize(q, wsf, algo.weight_fmt, algo.granularity)


def load_quantized(tensors: dict, spec: LinearSpec) -> nn.Module:
    algo = BY_QUANT_ALGO[spec.quant_algo]
    w = dequantize_weight(tensors, spec)
    pqs = _need(tensors, "prequant_scaling_factor", spec) if algo.prequant else None
    asf = _need(tensors, "activation_scaling_factor", spec) if algo.act_fmt else None
    return QuantLinear(w, pqs, asf, algo.act_fmt, tensors.get("bias"))


def kv_roundtrip(fmt: str):
    def fn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, scale.reshape(1), fmt)

    return fn


for _algo in BY_QUANT_ALGO:
    register_linear_loader(_algo, load_quantized)
register_kv_quant("FP8", kv_roundtrip("fp8"))
register_kv_quant("INT8", kv_roundtrip("int8"))
