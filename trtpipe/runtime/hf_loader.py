"""Load a Hugging Face checkpoint directory into a :class:`ReferenceModel`: plain, ModelOpt's unified HF format
(what TensorRT-LLM's PyTorch backend loads), or compressed-tensors (what vLLM / SGLang load).

Each HF projection becomes one module that dequantizes its stored weight once and fake-quantizes its input as
the serving kernel sees it (``trtpipe.export.formats`` / ``.compressed`` document the layouts):

* FP8 per tensor: static input scale; FP8 per channel ("per token" / FP8_DYNAMIC): a per-row dynamic FP8 scale.
* W4A16 AWQ: ``x * pre_quant_scale`` (o_proj, down_proj; q/k/v and gate/up have it folded into the norm);
  W4A8 AWQ: then FP8 with the static input scale, and the group scale divided by ``weight_scale_2`` in fp16
  as TensorRT-LLM's loader does.
* An FP8 KV cache is a round trip through FP8 with a unit scale: TensorRT-LLM's PyTorch backend ignores the
  checkpoint's ``k_scale``/``v_scale`` for FP8 KV (newest revision read; not confirmed for 1.0-1.2).

q/k/v and gate/up stay separate modules (their scales differ); their outputs are concatenated into the fused
layout the decoder layer computes with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from trtpipe.checkpoint.quant_primitives import unpack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.runtime.linear import Float32Linear, QuantLinear, TokenFP8Linear
from trtpipe.runtime.model import DecoderLayer, ModelArgs, ReferenceModel

class ConcatLinear(nn.Module):
    """Several projections of the same input, outputs concatenated (q;k;v as one fused linear)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def nvfp4_dequantize(packed: torch.Tensor, block_scale: torch.Tensor, wsf2: torch.Tensor) -> torch.Tensor:
    """U8 [out, in/2] E2M1 pairs (low nibble = even column) x FP8 [out, in/16] x F32 scalar -> float32 [out, in]."""
    from trtpipe.export.unified import E2M1_VALUES, NVFP4_BLOCK

    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    vals = E2M1_VALUES[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = block_scale.float() * wsf2.float()
    return (vals.reshape(vals.shape[0], -1, NVFP4_BLOCK) * scale.unsqueeze(-1)).reshape(vals.shape)


class NVFP4Linear(nn.Module):
    """``y = Q_nvfp4(x) @ W^T``: activations quantized per 16-element block (FP8 block scale, dynamic) under the
    static global ``input_scale``, as the NVFP4 GEMM receives them."""

    def __init__(self, weight: torch.Tensor, input_scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.input_scale = input_scale.float().reshape(())
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from trtpipe.export.unified import E2M1_VALUES, NVFP4_BLOCK, e2m1_codes, nvfp4_block_scales

        shape = x.shape
        flat = x.float().reshape(-1, shape[-1])
        bs = nvfp4_block_scales(flat, self.input_scale).float() * self.input_scale
        blocks = flat.reshape(flat.shape[0], -1, NVFP4_BLOCK)
        codes = e2m1_codes(blocks / bs.unsqueeze(-1)).long()
        xq = E2M1_VALUES[codes & 7] * torch.where(codes >= 8, -1.0, 1.0) * bs.unsqueeze(-1)
        return nn.functional.linear(xq.reshape(shape).to(x.dtype), self.weight, self.bias)


def _f(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


# --- ModelOpt unified HF ----------------------------------------------------------------------------------


def _modelopt_module(algo: str, t: dict, bias) -> nn.Module:
    w = t["weight"]
    if algo == "FP8":
        if "input_scale" not in t:
            raise CheckpointError("FP8 checkpoint: an input_scale is missing (static activation scales expected)")
        return QuantLinear(w.float() * t["weight_scale"].float(), None, t["input_scale"], "fp8", bias)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return TokenFP8Linear(w.float() * t["weight_scale"].float().reshape(-1, 1), bias)
    if algo == "W8A16":
        return QuantLinear(w.float() * t["weight_scale"].float().reshape(-1, 1), bias=bias)
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        q = unpack_int4_rows(w.view(torch.int8))
        ws = t["weight_scale"].float()
        g = q.shape[1] // ws.shape[1]
        if "weight_scale_2" in t:  # the loader: weight_scale = ws / ws2 in fp16, alpha = input_scale * ws2
            ws2 = t["weight_scale_2"].float()
            ws = (ws / ws2).half().float() * ws2
        deq = q.float() * ws.repeat_interleave(g, dim=-1)
        act = "fp8" if algo == "W4A8_AWQ" else None
        return QuantLinear(deq, t.get("pre_quant_scale"), t.get("input_scale"), act, bias)
    if algo == "NVFP4":
        return NVFP4Linear(nvfp4_dequantize(w, t["weight_scale"], t["weight_scale_2"]), t["input_scale"], bias)
    raise CheckpointError(f"hf_quant_config.json: quant_algo '{algo}' has no reference-runtime loader "
                          "(FP8, FP8_PER_CHANNEL_PER_TOKEN, W8A16, W4A16_AWQ, W4A8_AWQ, NVFP4)")


# --- compressed-tensors -------------------------------------------------------------------------------------


def _ct_module(group: dict, t: dict, bias) -> nn.Module:
    from trtpipe.export.compressed import unpack_int32_to_int4

    aargs = group.get("input_activations")
    ws = t["weight_scale"].float()
    if "weight_packed" in t:
        out_f, in_f = (int(x) for x in t["weight_shape"].tolist())
        q = unpack_int32_to_int4(t["weight_packed"], in_f).float()
        w = q * (ws.repeat_interleave(in_f // ws.shape[1], dim=-1) if ws.dim() == 2 and ws.shape[1] > 1
                 else ws.reshape(-1, 1) if ws.numel() > 1 else ws.reshape(()))
    else:
        w = t["weight"].float() * (ws.reshape(-1, 1) if ws.numel() > 1 else ws.reshape(()))
    if aargs is None:
        return QuantLinear(w, bias=bias)
    if aargs.get("dynamic"):
        if aargs.get("strategy") != "token":
            raise CheckpointError(f"config.json: dynamic activation strategy {aargs.get('strategy')!r} not supported")
        return TokenFP8Linear(w, bias)
    return QuantLinear(w, None, t["input_scale"].float().reshape(1), "fp8", bias)


# --- loading ------------------------------------------------------------------------------------------------


class _Reader:
    """All tensors of ``model.safetensors`` or its shards, read on demand."""

    def __init__(self, d: Path):
        index = d / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
            ["model.safetensors"]
        self.handles = []
        self.where: dict[str, object] = {}
        for f in files:
            if not (d / f).exists():
                raise CheckpointError(f"{d / f}: safetensors file not found")
            h = safe_open(str(d / f), framework="pt")
            self.handles.append(h)
            for k in h.keys():
                self.where[k] = h

    def __contains__(self, k: str) -> bool:
        return k in self.where

    def get(self, k: str) -> torch.Tensor:
        if k not in self.where:
            raise CheckpointError(f"checkpoint: tensor '{k}' is missing")
        return self.where[k].get_tensor(k)

    def module(self, prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: self.get(k) for k in self.where if k.startswith(prefix) and "." not in k[len(prefix):]}


def quant_scheme(d: Path, cfg: dict) -> tuple[str, dict]:
    """("none" | "modelopt" | "compressed-tensors", the config dict that describes it)."""
    hq = d / "hf_quant_config.json"
    if hq.exists():  # authoritative when present (TensorRT-LLM's rule)
        return "modelopt", json.loads(hq.read_text())["quantization"]
    qc = cfg.get("quantization_config")
    if not qc:
        return "none", {}
    method = str(qc.get("quant_method", ""))
    if method == "mxfp4":  # experts only (gpt-oss as shipped); their rules decode them, every linear is plain
        return "none", {}
    if method.startswith("modelopt"):
        return "modelopt", {"quant_algo": qc.get("quant_algo"), "exclude_modules": qc.get("ignore", []),
                            "kv_cache_quant_algo": "FP8" if qc.get("kv_cache_scheme") else None}
    if method == "compressed-tensors":
        return "compressed-tensors", qc
    raise CheckpointError(f"{d / 'config.json'}: quantization_config.quant_method '{method}' is not supported")


def load_hf_checkpoint(model_dir: str | Path) -> ReferenceModel:
    """Build the reference model of an HF checkpoint directory of any family trtpipe converts, quantized or not
    (MoE experts as modules of their own, as ModelOpt writes them)."""
    import fnmatch

    from trtpipe.checkpoint.convert import COMBINERS, make_plan
    from trtpipe.export.unified import HFNames

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    scheme, q = quant_scheme(d, cfg)
    names = HFNames(d)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    trt_cfg = dict(make_plan(d, tp=1, dtype=dtype).config)
    kv_algo = q.get("kv_cache_quant_algo") if scheme == "modelopt" else None
    if kv_algo not in (None, "FP8"):
        raise CheckpointError(f"{d}: kv_cache_quant_algo {kv_algo!r} is not supported (FP8 only)")
    trt_cfg["quantization"] = {"quant_algo": None, "kv_cache_quant_algo": kv_algo}
    args = ModelArgs.from_config(trt_cfg)
    r = _Reader(d)

    def excluded(module: str, patterns: list[str]) -> bool:
        return any(module == p or fnmatch.fnmatchcase(module, p) or p.startswith("re:") and
                   __import__("re").fullmatch(p[3:], module) for p in patterns)

    def build(module: str, row: bool = False) -> nn.Module:
        """``row``: a row-parallel projection, whose bias the decoder layer adds itself after the all-reduce."""
        t = r.module(module + ".")
        bias = None if row else _f(t.get("bias"))
        algo = q.get("quant_algo") if scheme == "modelopt" else None
        if algo == "MIXED_PRECISION":  # one quant_algo per module (MXFP4 experts as shipped beside FP8 attention)
            algo = (q.get("quantized_layers") or {}).get(module, {}).get("quant_algo")
        if algo and not excluded(module, q.get("exclude_modules", [])):
            return _modelopt_module(algo, t, bias)
        if scheme == "compressed-tensors" and not excluded(module, q.get("ignore", [])):
            group = next((g for g in q["config_groups"].values() if "Linear" in g.get("targets", [])), None)
            if group is not None:
                return _ct_module(group, t, bias)
        if not t["weight"].is_floating_point():
            raise CheckpointError(f"{d}: '{module}.weight' is {t['weight'].dtype} but the module is not quantized")
        return Float32Linear(t["weight"].float(), bias)

    rope = args.ropes()
    layers = []
    for i in range(args.num_layers):
        tensors: dict[str, torch.Tensor] = {}
        modules: dict[str, nn.Module] = {}
        pre = names.prefix.format(i)
        experts: dict[str, list[nn.Module]] = {}  # stacked-expert linear -> one module per expert
        for trt_rel, parts in names.layer.items():
            if trt_rel in names.fused:  # fused experts (gpt-oss; MXFP4 decoded): the conversion's own combine
                rule = names.fused[trt_rel]
                tensors[trt_rel] = COMBINERS[rule.combine]([[r.get(pre + h)] for h in rule.hf]).float()
                continue
            if trt_rel in names.experts:  # MoE: each expert's projections are modules of their own
                linear = trt_rel.rsplit(".", 1)[0]
                mods = [[build(pre + h.format(e=e).rsplit(".", 1)[0]) for h, _ in parts] for e in range(args.num_experts)]
                experts[linear] = [m[0] if len(m) == 1 else ConcatLinear(m) for m in mods]
                tensors[trt_rel] = torch.stack([torch.cat([_weight_of(x) for x in m], dim=0) for m in mods])
                continue
            hf_full = [pre + h for h, _ in parts]
            if trt_rel.endswith(".weight") and trt_rel.rsplit(".", 1)[0] in _LINEAR_ATTR:
                linear = trt_rel.rsplit(".", 1)[0]
                mods = [build(h.rsplit(".", 1)[0], linear in _ROW) for h in hf_full]
                modules[linear] = mods[0] if len(mods) == 1 else ConcatLinear(mods)
                tensors[trt_rel] = torch.cat([_weight_of(m) for m in mods], dim=0)
            else:
                tensors[trt_rel] = names.from_hf(trt_rel, torch.cat([r.get(h).float() for h in hf_full], dim=0))
        if kv_algo:
            tensors["attention.kv_cache_scaling_factor"] = torch.ones(1)
        layer = DecoderLayer(args, [tensors], i, rope)
        for linear, module in modules.items():
            owner, attr = _LINEAR_ATTR[linear]
            setattr(getattr(layer, owner)[0], attr, module)
        for linear, mods in experts.items():  # fc = [up; gate] of each expert, proj = its down_proj
            setattr(layer.mlp[0], linear.split(".")[1], nn.ModuleList(mods))
        layers.append(layer)
        del tensors
    embedding = r.get(names.globals["transformer.vocab_embedding.weight"]).float()
    ln_f = names.from_hf("transformer.ln_f.weight", r.get(names.globals["transformer.ln_f.weight"]))
    head_name = names.globals.get("lm_head.weight", "lm_head.weight")
    head = r.get(head_name).float() if head_name in r else embedding
    trt_cfg["hf_quantization"] = {"scheme": scheme, **({"quant_algo": q.get("quant_algo")} if scheme == "modelopt" else {})}
    return ReferenceModel(trt_cfg, args, embedding, layers, ln_f, [Float32Linear(head)])


# TRT-LLM linear -> (DecoderLayer attribute holding the shard list, attribute of the shard)
_LINEAR_ATTR = {"attention.qkv": ("attention", "qkv"), "attention.dense": ("attention", "dense"),
                "mlp.fc": ("mlp", "fc"), "mlp.gate": ("mlp", "gate"), "mlp.proj": ("mlp", "proj")}


_ROW = ("attention.dense", "mlp.proj")  # row-parallel: biases added once by the layer (DecoderLayer.dense_bias ...)


def _weight_of(m: nn.Module) -> torch.Tensor:
    return m.weight.detach()


