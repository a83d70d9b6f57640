"""Build each linear layer of a TRT-LLM checkpoint from its tensors, through a registry keyed by quant_algo.

Policy: dequantize (or fake-quantize) at load time and compute in float32: the runtime checks numbers,
not speed. The unquantized handler lives here; the quantization package registers the others with one
line each::

    register_linear_loader("FP8", load_fp8_linear)      # fn(tensors, spec) -> nn.Module
    register_kv_quant("FP8", fake_quant_fp8_kv)          # fn(x, scale) -> x after a quantize round trip

A loader receives the tensors of one linear on one rank, keyed by suffix (``weight``, ``bias``,
``weights_scaling_factor``, ...) and a :class:`LinearSpec`; it returns a module mapping
``[..., in_r] -> [..., out_r]`` in float32. Row-parallel linears never receive ``bias``: the runtime adds
it once, after the simulated all-reduce, as TensorRT-LLM's RowLinear does.
"""

from __future__ import annotations

import fnmatch
import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from trtpipe.errors import CheckpointError

# TensorRT-LLM's QuantConfig: when exclude_modules is null the builder excludes these.
DEFAULT_EXCLUDES = ("*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding", "*shared_expert_gate")


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

_LINEAR_LOADERS: dict[str, LinearLoader] = {}
_KV_QUANT: dict[str, KVQuant] = {}


def register_linear_loader(quant_algo: str, fn: LinearLoader) -> None:
    """Register the loader for one ``quant_algo`` (``"NONE"`` is the unquantized one)."""
    _LINEAR_LOADERS[quant_algo] = fn


def register_kv_quant(kv_cache_quant_algo: str, fn: KVQuant) -> None:
    """Register the KV-cache quantize round trip for ``FP8`` / ``INT8``: ``fn(x[B,h,T,d], scale[1]) -> x``."""
    _KV_QUANT[kv_cache_quant_algo] = fn


def _lookup(table: dict, key: str, what: str):
    if key not in table:
        # The quantization package's reference module registers every quantized handler on import.
        importlib.import_module("trtpipe.quant.reference")
    if key not in table:
        raise CheckpointError(f"config.json: {what} '{key}' has no runtime handler (known: {sorted(table)})")
    return table[key]


def kv_quant(kv_cache_quant_algo: Optional[str]) -> Optional[KVQuant]:
    return None if not kv_cache_quant_algo else _lookup(_KV_QUANT, kv_cache_quant_algo, "kv_cache_quant_algo")


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
    """One rank's linear from its tensors (suffix -> tensor) via the loader registered for its quant_algo."""
    if "weight" not in tensors:
        raise CheckpointError(f"checkpoint: tensor '{spec.name}.weight' is missing")
    return _lookup(_LINEAR_LOADERS, spec.quant_algo or "NONE", "quant_algo")(tensors, spec)


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


register_linear_loader("NONE", _load_unquantized)
