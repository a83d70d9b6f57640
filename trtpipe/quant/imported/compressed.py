"""compressed-tensors checkpoints (llm-compressor ``oneshot`` / ``model_free_ptq`` output, compressed-tensors 0.20).

Config: ``config.json: quantization_config`` with ``quant_method: compressed-tensors``, ``format``,
``config_groups`` (one scheme per group: ``weights`` / ``input_activations`` args), ``ignore`` and
``kv_cache_scheme``. Schemes and their canonical ModelOpt re-layout (exact: codes and scales are copied, scales
widened from the model dtype to float32, which loses nothing):

=====================================  ==========================  ============================================
scheme (weights; input activations)    canonical quant_algo        re-layout
=====================================  ==========================  ============================================
float8 tensor; float8 tensor static    FP8                         weight as is; scales ``[1]`` -> F32 ``[]``
float8 channel; float8 token dynamic   FP8_PER_CHANNEL_PER_TOKEN   weight as is; ``weight_scale [out, 1]`` -> ``[out]``
int4 group g symmetric; none           W4A16_AWQ (unit pre-quant)  ``weight_packed`` (8 signed codes per int32 along
                                                                   the input) -> two output rows per byte
int4 group g asymmetric; none          W4A16_AWQ + zero_point      as above; ``weight_zero_point`` (signed, 8 per
                                       (engine target only)        int32 along the outputs) -> int8 ``[out, in/g]``
int8 channel symmetric; int8 token     W8A8_SQ_PER_CHANNEL_PER_    weight as is (I8 ``[out, in]``); ``weight_scale
dynamic symmetric                      TOKEN_PLUGIN (engine only)  [out, 1]`` -> F32 ``[out]``
=====================================  ==========================  ============================================

INT8 W8A8 has no ModelOpt form: its canonical tensors are W8A16's (codes and per-row scales), under the name of the
TensorRT-LLM algorithm they are converted into, the plugin SmoothQuant layout with per-token dynamic activations
(:mod:`trtpipe.quant.imported.trtllm` documents it). llm-compressor's SmoothQuantModifier folds its smoothing into
the norms and weights before quantizing, so the checkpoint has nothing left to smooth with.

KV cache (``kv_cache_scheme`` float 8 tensor): ``self_attn.k_scale`` / ``v_scale`` -> ModelOpt's
``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``. Everything else (block FP8, INT8 W8A8 other than per-channel
weights with dynamic per-token activations, several config groups) is recognised and refused with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from trtpipe.formats.primitives import pack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.formats.dequant import unpack_int32_to_int4
from trtpipe.quant.imported.formats import CONVERTED, REFUSED, RELAID, Action, ImportedFormat
from trtpipe.quant.imported.others import NO_ENGINE_LAYER

KNOWN_SUFFIXES = {"weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "input_scale", "bias"}


def _scheme(w: dict, a: Optional[dict]) -> tuple[str, Optional[str], Optional[int]]:
    """(scheme name, canonical quant_algo or None, group size) of one config group."""
    typ, bits, strat = w.get("type"), w.get("num_bits"), w.get("strategy")
    sym = w.get("symmetric", True)
    if typ == "float" and bits == 8:
        if (
            strat == "tensor"
            and a
            and a.get("type") == "float"
            and a.get("strategy") == "tensor"
            and not a.get("dynamic")
        ):
            return "FP8 static", "FP8", None
        if strat == "channel" and a and a.get("strategy") == "token" and a.get("dynamic"):
            return "FP8 dynamic", "FP8_PER_CHANNEL_PER_TOKEN", None
        if strat == "block":
            return f"FP8 block {w.get('block_structure')}", None, None
        return f"FP8 {strat} weights", None, None
    if typ == "int" and bits == 8 and a is not None:
        per_token = (
            a.get("type"),
            a.get("num_bits"),
            a.get("strategy"),
            bool(a.get("dynamic")),
            a.get("symmetric", True),
        ) == ("int", 8, "token", True, True)
        if strat == "channel" and sym and per_token:
            return "W8A8 INT8", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", None
        return f"W8A8 INT8 {strat} weights, {a.get('strategy')} activations", None, None
    if typ == "int" and bits == 4 and a is None and strat == "group":
        g = w.get("group_size")
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"group_size {g!r}")
        return ("W4A16" if sym else "W4A16 asymmetric"), "W4A16_AWQ", g
    return f"int{bits} {strat}" if typ == "int" else f"{typ}{bits} {strat}", None, None


NO_INT8_W8A8_METHOD = (
    "TensorRT-LLM 1.2's PyTorch backend has no INT8 W8A8 method (its compressed-tensors parser "
    "misroutes it to FP8); use target: engine or an FP8 checkpoint"
)
REFUSALS = {
    "FP8 block": (
        NO_ENGINE_LAYER.format(what="block-scaled FP8"),
        "trtpipe does not re-lay out compressed-tensors FP8 block checkpoints yet",
    ),
    "W8A8 INT8": (
        "TensorRT-LLM's plugin SmoothQuant layers take INT8 weights per channel or per tensor with INT8 "
        "activations per token or per tensor; trtpipe converts per-channel symmetric weights with dynamic "
        "symmetric per-token activations only",
        NO_INT8_W8A8_METHOD,
    ),
}
# scheme -> the llmapi refusal of a scheme the engine target converts but the PyTorch backend cannot load
LLMAPI_ONLY_REFUSALS = {
    "W4A16 asymmetric": "TensorRT-LLM 1.2's W4A16_AWQ kernel has no zero point; use a symmetric W4A16 checkpoint",
    "W8A8 INT8": NO_INT8_W8A8_METHOD,
}
ZERO_POINT_SCHEMES = ("W4A16 asymmetric",)
# algorithms whose per-row weight_scale is checked as stored ([out, 1]), before the reshape hides a wrong shape
STRICT_ROW_SCALES = ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",)
# canonical quant_algo -> how the engine action names its conversion (default: via the ModelOpt algorithm)
ENGINE_VIA = {
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": "into TensorRT-LLM's plugin SmoothQuant layout "
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
}


def parse(model_dir: Path, qc: dict) -> ImportedFormat:
    where = f"{model_dir / 'config.json'}"
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: quantization_config.config_groups is missing or empty")
    schemes = []
    for gname, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
            raise CheckpointError(f"{where}: quantization_config.config_groups.{gname}.weights is missing")
        try:
            schemes.append(_scheme(g["weights"], g.get("input_activations")))
        except ValueError as exc:
            raise CheckpointError(f"{where}: quantization_config.config_groups.{gname}.weights: {exc}") from None
        if g["weights"].get("actorder") == "group":
            raise CheckpointError(
                f"{where}: quantization_config.config_groups.{gname}.weights.actorder 'group' "
                "(a weight_g_idx per layer) is refused: kernels without g_idx cannot run it"
            )
    if len(set(schemes)) > 1:
        raise CheckpointError(
            f"{where}: quantization_config.config_groups has {len(groups)} different schemes; "
            "one is imported (TensorRT-LLM reads group_0 only)"
        )
    name, algo, group = schemes[0]
    kv_s = qc.get("kv_cache_scheme")
    kv = None
    if kv_s:
        if kv_s.get("type") != "float" or kv_s.get("num_bits") != 8 or kv_s.get("strategy") != "tensor":
            raise CheckpointError(
                f"{where}: quantization_config.kv_cache_scheme {kv_s} is not imported (FP8 per-tensor only)"
            )
        kv = "FP8"
    fmt = qc.get("format")
    zero_point = name in ZERO_POINT_SCHEMES
    if algo is not None:
        engine = Action(
            CONVERTED, ENGINE_VIA.get(algo, f"via ModelOpt {algo}") + (" with zero points" if zero_point else "")
        )
        llmapi = (
            Action(REFUSED, LLMAPI_ONLY_REFUSALS[name])
            if name in LLMAPI_ONLY_REFUSALS
            else Action(RELAID, f"ModelOpt {algo}")
        )
    else:
        key = next((k for k in REFUSALS if name.startswith(k)), None)
        e, l = REFUSALS.get(key, (f"compressed-tensors scheme '{name}' is not imported",) * 2)
        engine, llmapi = Action(REFUSED, e), Action(REFUSED, l)
    bits = int(next(iter(groups.values()))["weights"].get("num_bits") or 0) or None
    gran = "group" if group else ("per-tensor" if algo == "FP8" else "per-channel")
    return ImportedFormat(
        "compressed-tensors",
        f"{name} ({fmt})",
        algo,
        bits,
        group,
        gran,
        tuple(qc.get("ignore") or ()),
        kv,
        engine,
        llmapi,
        where,
        {"format": fmt, "zero_point": zero_point},
    )


def _zero_point(zp: torch.Tensor, out_f: int, scale_shape: tuple, what: str) -> torch.Tensor:
    """``weight_zero_point`` int32 ``[ceil(out/8), in/g]`` (signed 4-bit zeros packed along the outputs, dim 0) ->
    int8 ``[out, in/g]`` (compressed-tensors 0.20 ``pack_quantized/base.py``, ``packed_dim=0``)."""
    want = (-(-out_f // 8), scale_shape[1])
    if zp.dtype != torch.int32 or tuple(zp.shape) != want:
        raise CheckpointError(
            f"{what}.weight_zero_point' is {zp.dtype} {list(zp.shape)}, a weight_scale of "
            f"{list(scale_shape)} packs its zero points into int32 {list(want)}"
        )
    if zp.device.type == "meta":
        return torch.empty(scale_shape, dtype=torch.int8, device="meta")
    return unpack_int32_to_int4(zp.t().contiguous(), out_f).t().contiguous()


def canonical(
    fmt: ImportedFormat, t: dict[str, torch.Tensor], module: str, where: str, out_f: int, in_f: int
) -> dict[str, torch.Tensor]:
    """One ``[out_f, in_f]`` projection's compressed-tensors tensors -> ModelOpt's (``fmt.quant_algo``), exactly
    (meta tensors give meta tensors of the right shapes)."""
    out = {k: v for k, v in t.items() if k == "bias"}
    extra = set(t) - KNOWN_SUFFIXES
    if extra:
        raise CheckpointError(f"{where}: tensor '{module}.{sorted(extra)[0]}' is not part of {fmt.name}")
    if fmt.quant_algo == "W4A16_AWQ":
        if "weight_packed" not in t or "weight_shape" not in t or "weight_scale" not in t:
            missing = next(k for k in ("weight_packed", "weight_shape", "weight_scale") if k not in t)
            raise CheckpointError(f"{where}: tensor '{module}.{missing}' is missing (pack-quantized W4A16)")
        zp = t.get("weight_zero_point")
        if zp is not None and not fmt.params.get("zero_point"):
            raise CheckpointError(f"{where}: tensor '{module}.weight_zero_point' in a symmetric scheme")
        if zp is None and fmt.params.get("zero_point"):
            raise CheckpointError(f"{where}: tensor '{module}.weight_zero_point' is missing (asymmetric scheme)")
        shape = t["weight_shape"]
        if shape.device.type != "meta" and [int(x) for x in shape.reshape(-1).tolist()] != [out_f, in_f]:
            raise CheckpointError(
                f"{where}: tensor '{module}.weight_shape' is {shape.tolist()}, config.json implies [{out_f}, {in_f}]"
            )
        if t["weight_packed"].dtype != torch.int32 or t["weight_packed"].shape != (out_f, -(-in_f // 8)):
            raise CheckpointError(
                f"{where}: tensor '{module}.weight_packed' has shape {list(t['weight_packed'].shape)}, "
                f"weight_shape [{out_f}, {in_f}] packs into [{out_f}, {-(-in_f // 8)}]"
            )
        if t["weight_packed"].device.type == "meta":
            out["weight"] = torch.empty(out_f // 2, in_f, dtype=torch.uint8, device="meta")
        else:
            out["weight"] = pack_int4_rows(unpack_int32_to_int4(t["weight_packed"], in_f)).view(torch.uint8)
        out["weight_scale"] = t["weight_scale"].float()
        if zp is not None:
            out["zero_point"] = _zero_point(zp, out_f, tuple(t["weight_scale"].shape), f"{where}: tensor '{module}")
        return out
    if "weight" not in t or "weight_scale" not in t:
        raise CheckpointError(
            f"{where}: tensor '{module}.{'weight' if 'weight' not in t else 'weight_scale'}' is missing ({fmt.name})"
        )
    out["weight"] = t["weight"]
    ws = t["weight_scale"]
    if fmt.quant_algo in STRICT_ROW_SCALES and tuple(ws.shape) not in ((out_f, 1), (out_f,)):
        raise CheckpointError(
            f"{where}: tensor '{module}.weight_scale' has shape {list(ws.shape)}, {fmt.name} "
            f"stores one scale per output row ([{out_f}, 1])"
        )
    if fmt.quant_algo == "FP8":
        out["weight_scale"] = t["weight_scale"].float().reshape(())
        if "input_scale" not in t:
            raise CheckpointError(f"{where}: tensor '{module}.input_scale' is missing (static FP8 activations)")
        out["input_scale"] = t["input_scale"].float().reshape(())
    else:
        out["weight_scale"] = t["weight_scale"].float().reshape(-1)
    return out
