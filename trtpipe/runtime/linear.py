"""Build each linear layer of a TRT-LLM checkpoint from its tensors, through tables keyed by quant_algo.

Policy: dequantize (or fake-quantize) at load time and compute in float32: the runtime checks numbers,
not speed. The runtime reads every quantized layout TensorRT-LLM's does, so the handlers are data here:
:data:`LINEAR_LOADERS` (``quant_algo -> fn(tensors, spec) -> nn.Module``) and :data:`KV_QUANT`
(``kv_cache_quant_algo -> fn(x, scale) -> x`` after a quantize round trip), built from the layout table of
:mod:`trtpipe.checkpoint.quant_layouts` that the quantization package writes by. Nothing here imports
``trtpipe.quant``: quantization runs models on this runtime, never the other way.

Each quantized loader dequantizes the stored weight once and fake-quantizes activations the way the TensorRT-LLM
kernel sees them: FP8 / INT8 static per-tensor input scales, the SmoothQuant / AWQ pre-quant scale multiplied
into the input first (``x * pqs``), W4A8's group scale divided by ``weights_scaling_factor_2`` in fp16 as the
builder does, a groupwise ``zero`` ``[in/g, out]`` added per group where ``has_zero_point`` (``W = q * s + zero``);
the plugin SmoothQuant layout's activations quantized to INT8 per token dynamically (:func:`token_int8`); NVFP4's
E2M1 codes times FP8 block scales times the global scale, activations through NVFP4 with dynamic block scales under
the static ``activation_scaling_factor`` (:class:`NVFP4Linear`, the same functions the unified-HF loader uses).
KV-cache handlers round-trip keys and values through FP8 / INT8 with the layer's scale.

A loader receives the tensors of one linear on one rank, keyed by suffix (``weight``, ``bias``,
``weights_scaling_factor``, ...) and a :class:`LinearSpec`; it returns a module mapping
``[..., in_r] -> [..., out_r]`` in float32. Row-parallel linears never receive ``bias``: the runtime adds
it once, after the simulated all-reduce, as TensorRT-LLM's RowLinear does.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from trtpipe.checkpoint.quant_layouts import BY_QUANT_ALGO
from trtpipe.formats.primitives import (
    FORMATS,
    NVFP4_BLOCK,
    dequantize,
    fake_quant,
    nvfp4_dequantize,
    nvfp4_fake_quant,
    unpack_int4_rows,
)
from trtpipe.errors import CheckpointError

# TensorRT-LLM's QuantConfig: when exclude_modules is null the builder excludes these.
DEFAULT_EXCLUDES = (
    "*lm_head",
    "*router",
    "*vocab_embedding",
    "*position_embedding",
    "*block_embedding",
    "*shared_expert_gate",
)


@dataclass(frozen=True)
class LinearSpec:
    """What a loader may need to know about the linear it builds.

    Attributes:
        name: full module name, e.g. ``transformer.layers.3.attention.qkv`` or ``lm_head``.
        quant_algo: the algorithm that applies to this module (None: unquantized).
        quantization: the checkpoint's whole ``quantization`` dict (group_size, flags, ...).
        dtype: the checkpoint's model dtype string.
        style: ``column`` or ``row`` (the tensors are already this rank's shard).
        rank: tp rank of the shard; tp_size: tensor-parallel size.
    """

    name: str
    quant_algo: Optional[str]
    quantization: dict = field(default_factory=dict)
    dtype: str = "float32"
    style: str = "column"
    rank: int = 0
    tp_size: int = 1


LinearLoader = Callable[[dict, LinearSpec], nn.Module]
KVQuant = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        raise CheckpointError(f"config.json: {what} '{key}' has no runtime handler (known: {sorted(table)})")
    return table[key]


def kv_quant(kv_cache_quant_algo: Optional[str]) -> Optional[KVQuant]:
    """The KV-cache round trip of ``FP8`` / ``INT8`` (``fn(x[B,h,T,d], scale[1]) -> x``); None when unquantized."""
    return None if not kv_cache_quant_algo else _lookup(KV_QUANT, kv_cache_quant_algo, "kv_cache_quant_algo")


def module_quant_algo(name: str, quantization: dict, quant_cfg: Optional[dict] = None) -> Optional[str]:
    """The quant_algo that applies to module ``name`` (exclude_modules and MIXED_PRECISION honoured)."""
    algo = (quantization or {}).get("quant_algo")
    if not algo or algo == "NO_QUANT":
        return None
    if algo == "MIXED_PRECISION":
        layers = (quant_cfg or {}).get("quantized_layers", {})
        for pattern, layer_cfg in layers.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                return layer_cfg.get("quant_algo")
        return None
    excludes = quantization.get("exclude_modules")
    excludes = DEFAULT_EXCLUDES if excludes is None else excludes
    if any(fnmatch.fnmatchcase(name, p) for p in excludes):
        return None
    return algo


def build_linear(tensors: dict, spec: LinearSpec) -> nn.Module:
    """One rank's linear from its tensors (suffix -> tensor) via the loader of its quant_algo in :data:`LINEAR_LOADERS`."""
    if "weight" not in tensors:
        raise CheckpointError(f"checkpoint: tensor '{spec.name}.weight' is missing")
    return _lookup(LINEAR_LOADERS, spec.quant_algo or "NONE", "quant_algo")(tensors, spec)


class Float32Linear(nn.Module):
    """y = x W^T (+ b) in float32."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)  # [out, in]
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _load_unquantized(tensors: dict, spec: LinearSpec) -> nn.Module:
    weight = tensors["weight"]
    if not weight.is_floating_point():
        raise CheckpointError(
            f"checkpoint: '{spec.name}.weight' is {weight.dtype} but the module is not quantized "
            "(check quantization.quant_algo / exclude_modules)"
        )
    return Float32Linear(weight, tensors.get("bias"))


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


class TokenFP8Linear(nn.Module):
    """``y = Q_token(x) @ W^T``: activations quantized to FP8 per token (row) with scale amax/448 (the amax capped
    at ``scale_ub`` when given: fbgemm's ``quantize_fp8_per_row(x, scale_ub)``)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, scale_ub: Optional[float] = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.bias = None if bias is None else bias.float()
        self.scale_ub = scale_ub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(token_fp8(x, self.scale_ub).to(x.dtype), self.weight, self.bias)


def token_fp8(x: torch.Tensor, scale_ub: Optional[float] = None) -> torch.Tensor:
    """float32 ``x`` through FP8 per row (last axis) with the dynamic scale ``min(amax, scale_ub) / 448``."""
    amax = x.abs().amax(-1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp_max(scale_ub)
    scale = (amax / FORMATS["fp8"].qmax).clamp_min(torch.finfo(torch.float32).eps)
    return (x.float() / scale).clamp(-FORMATS["fp8"].qmax, FORMATS["fp8"].qmax).to(torch.float8_e4m3fn).float() * scale


# The per-token INT8 divisor of each dynamic scheme: scale = amax / divisor per token (row).
INT8_TOKEN_DIVISOR = {
    # compressed-tensors 0.19 calculate_qparams: max / ((q_max - q_min) / 2), half the 256-code range
    "compressed-tensors": 127.5,
    # TensorRT-LLM quantize_per_token / the RmsNorm quantization plugin: amax / 127, rounded half to even and
    # saturated (an assumption: the 1.2 kernel source was not read)
    "tensorrt-llm": 127.0,
}


def token_int8(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x`` through symmetric INT8 per token (last axis): scale ``amax / divisor``, codes rounded half to even
    and clamped to -128..127, dequantized in ``x``'s precision (float32, or float64 for the tests' reference);
    an all-zero token gets the dtype's eps as its scale."""
    xf = x if x.dtype == torch.float64 else x.float()
    scale = xf.abs().amax(-1, keepdim=True) / divisor
    scale = torch.where(scale == 0, torch.finfo(xf.dtype).eps, scale)
    return (xf / scale).round().clamp(-128, 127) * scale


class TokenInt8Linear(nn.Module):
    """``y = Q_token(x / smoother) @ W^T``: activations quantized to INT8 per token (:func:`token_int8` with
    ``divisor``); ``smoother`` (plugin SmoothQuant row linears) divides the input first."""

    def __init__(
        self,
        weight: torch.Tensor,
        divisor: float,
        bias: Optional[torch.Tensor] = None,
        smoother: Optional[torch.Tensor] = None,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.divisor = divisor
        self.bias = None if bias is None else bias.float()
        self.smoother = None if smoother is None else smoother.float().reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.smoother is not None:
            x = x / self.smoother
        return nn.functional.linear(token_int8(x, self.divisor).to(x.dtype), self.weight, self.bias)


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
        w = dequantize(q, wsf, "int4", g)
        if (spec.quantization or {}).get("has_zero_point"):  # groupwise zero [in/g, out]: W = q * s + zero
            w = w + _need(tensors, "zero", spec).float().t().repeat_interleave(g, dim=1)
        return w
    want = FORMATS[algo.weight_fmt].dtype
    if q.dtype == torch.int8 and want == torch.float8_e4m3fn:
        q = q.view(want)  # TRT-LLM also accepts FP8 weights stored as int8 bit patterns
    if q.dtype != want:
        raise CheckpointError(f"checkpoint: '{spec.name}.weight' is {q.dtype}, {spec.quant_algo} needs {want}")
    return dequantize(q, wsf, algo.weight_fmt, algo.granularity)


def load_quantized(tensors: dict, spec: LinearSpec) -> nn.Module:
    """A quantized linear of any quant_algo in the layout table (its row of the table says what it holds)."""
    algo = BY_QUANT_ALGO[spec.quant_algo]
    w = dequantize_weight(tensors, spec)
    pqs = _need(tensors, "prequant_scaling_factor", spec) if algo.prequant else None
    asf = _need(tensors, "activation_scaling_factor", spec) if algo.act_fmt else None
    return QuantLinear(w, pqs, asf, algo.act_fmt, tensors.get("bias"))


def load_fp8_rowwise(tensors: dict, spec: LinearSpec) -> nn.Module:
    """``FP8_PER_CHANNEL_PER_TOKEN``: FP8 weight x ``per_channel_scale`` [out], activations FP8 per token."""
    q, s = _need(tensors, "weight", spec), _need(tensors, "per_channel_scale", spec)
    if q.dtype == torch.int8:
        q = q.view(torch.float8_e4m3fn)
    if q.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"checkpoint: '{spec.name}.weight' is {q.dtype}, {spec.quant_algo} needs float8_e4m3fn")
    return TokenFP8Linear(dequantize(q, s.reshape(-1), "fp8", "channel"), tensors.get("bias"))


def load_sq_per_token(tensors: dict, spec: LinearSpec) -> nn.Module:
    """``W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN``: INT8 weight [out, in] x ``per_channel_scale`` [1, out]; the input
    divided by ``smoother`` [1, in] (row linears, which always have one) and quantized to INT8 per token as
    ``quantize_per_token`` / the norm quantization plugin do (:data:`INT8_TOKEN_DIVISOR`)."""
    q, s = _need(tensors, "weight", spec), _need(tensors, "per_channel_scale", spec)
    if q.dtype != torch.int8:
        raise CheckpointError(f"checkpoint: '{spec.name}.weight' is {q.dtype}, {spec.quant_algo} needs torch.int8")
    if s.numel() != q.shape[0]:
        raise CheckpointError(
            f"checkpoint: tensor '{spec.name}.per_channel_scale' has shape {list(s.shape)}, "
            f"{spec.quant_algo} stores [1, {q.shape[0]}]"
        )
    smoother = _need(tensors, "smoother", spec) if spec.style == "row" else None
    if smoother is not None and smoother.numel() != q.shape[1]:
        raise CheckpointError(
            f"checkpoint: tensor '{spec.name}.smoother' has shape {list(smoother.shape)}, "
            f"{spec.quant_algo} stores [1, {q.shape[1]}]"
        )
    return TokenInt8Linear(
        dequantize(q, s.reshape(-1), "int8", "channel"),
        INT8_TOKEN_DIVISOR["tensorrt-llm"],
        tensors.get("bias"),
        smoother,
    )


class NVFP4Linear(nn.Module):
    """``y = Q_nvfp4(x) @ W^T``: activations quantized per 16-element block (FP8 block scale, dynamic) under the
    static global ``input_scale``, as the NVFP4 GEMM receives them (:func:`nvfp4_fake_quant`)."""

    def __init__(self, weight: torch.Tensor, input_scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.input_scale = input_scale.float().reshape(())
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nvfp4_fake_quant(x, self.input_scale), self.weight, self.bias)


def load_nvfp4(tensors: dict, spec: LinearSpec) -> nn.Module:
    """``NVFP4``: U8 ``weight`` [out, in/2] (E2M1 pairs, low nibble = even column), F8 ``weights_scaling_factor``
    [out, in/16] (block scales), F32 ``weights_scaling_factor_2`` [1] (global) and ``activation_scaling_factor`` [1]
    (the activations' global scale), as ModelOpt's TensorRT-LLM export writes them and TensorRT-LLM 1.2's
    ``preprocess_perlayer_weights`` reads them (it derives the interleaved block scales and ``alpha`` itself)."""
    q, bs = _need(tensors, "weight", spec), _need(tensors, "weights_scaling_factor", spec)
    ws2 = _need(tensors, "weights_scaling_factor_2", spec)
    asf = _need(tensors, "activation_scaling_factor", spec)
    if q.dtype not in (torch.uint8, torch.int8):
        raise CheckpointError(
            f"checkpoint: '{spec.name}.weight' is {q.dtype}, NVFP4 stores uint8 (two E2M1 codes a byte)"
        )
    if bs.dtype != torch.float8_e4m3fn or tuple(bs.shape) != (q.shape[0], 2 * q.shape[1] // NVFP4_BLOCK):
        raise CheckpointError(
            f"checkpoint: tensor '{spec.name}.weights_scaling_factor' is {bs.dtype} {list(bs.shape)}, "
            f"NVFP4 stores float8_e4m3fn [{q.shape[0]}, {2 * q.shape[1] // NVFP4_BLOCK}]"
        )
    for key, t in (("weights_scaling_factor_2", ws2), ("activation_scaling_factor", asf)):
        if t.numel() != 1:
            raise CheckpointError(f"checkpoint: tensor '{spec.name}.{key}' has shape {list(t.shape)}, NVFP4 stores [1]")
    return NVFP4Linear(nvfp4_dequantize(q.view(torch.uint8), bs, ws2), asf, tensors.get("bias"))


def kv_roundtrip(fmt: str) -> KVQuant:
    """The KV-cache handler of one format: keys and values through a quantize round trip with the layer's scale."""

    def fn(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, scale.reshape(1), fmt)

    return fn


LINEAR_LOADERS: dict[str, LinearLoader] = {
    "NONE": _load_unquantized,
    **{algo: load_quantized for algo in BY_QUANT_ALGO},
    "FP8_PER_CHANNEL_PER_TOKEN": load_fp8_rowwise,
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": load_sq_per_token,
    "NVFP4": load_nvfp4,
}
KV_QUANT: dict[str, KVQuant] = {"FP8": kv_roundtrip("fp8"), "INT8": kv_roundtrip("int8")}
