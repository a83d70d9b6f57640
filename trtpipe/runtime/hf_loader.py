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

Checkpoints of the other producers run as their formats define them (weights: :mod:`trtpipe.formats.dequant`,
one pure function per format; activations as each format's reference forward quantizes them):

* GPTQ (v1 / v2, any zero points and ``g_idx``) and AutoAWQ GEMM: weight-only (``qweight`` / ``qzeros`` /
  ``scales``).
* compressed-tensors asymmetric 4-bit (``weight_zero_point``): weight-only; INT8 W8A8: INT8 weights, activations
  INT8 per token with compressed-tensors' dynamic scale ``amax / 127.5`` (``calculate_qparams``: half the
  256-code range), rounded half to even and clamped to -128..127; FP8 block: ``weight_scale`` per block,
  activations FP8 per token and group of ``group_size`` inputs (dynamic).
* FP8 block-scaled (``quant_method: fp8``, DeepSeek's ``weight_scale_inv``): activations FP8 per token and group
  of ``weight_block_size[1]`` inputs, the dynamic scheme transformers' ``FP8Linear`` and TensorRT-LLM's
  ``FP8BlockScales`` linear use.
* fbgemm FP8: FP8 per-row weights, activations FP8 per token with the amax capped at ``activation_scale_ub``
  (``quantize_fp8_per_row(x, scale_ub)``).
* MXFP4 (gpt-oss experts): decoded by the family's expert rules (:mod:`trtpipe.formats.mxfp4`); its other linears
  are plain.

q/k/v and gate/up stay separate modules (their scales differ); their outputs are concatenated into the fused
layout the decoder layer computes with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import nn

from trtpipe.formats.primitives import nvfp4_dequantize, unpack_int4_rows
from trtpipe.errors import CheckpointError
from trtpipe.formats import dequant
from trtpipe.runtime.linear import (
    INT8_TOKEN_DIVISOR,
    Float32Linear,
    NVFP4Linear,
    QuantLinear,
    TokenFP8Linear,
    TokenInt8Linear,
    token_fp8,
)
from trtpipe.runtime.loader import load_checkpoint
from trtpipe.runtime.model import DecoderLayer, ModelArgs, ReferenceModel
from trtpipe.jsonfile import load_json


class ConcatLinear(nn.Module):
    """Several projections of the same input, outputs concatenated (q;k;v as one fused linear)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


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
    raise CheckpointError(
        f"hf_quant_config.json: quant_algo '{algo}' has no reference-runtime loader "
        "(FP8, FP8_PER_CHANNEL_PER_TOKEN, W8A16, W4A16_AWQ, W4A8_AWQ, NVFP4)"
    )


# --- compressed-tensors -------------------------------------------------------------------------------------


class GroupFP8Linear(nn.Module):
    """``y = Q(x) @ W^T``: activations quantized to FP8 per token and group of ``group`` inputs (dynamic scale
    amax / 448 each; a last group narrower than ``group`` keeps its own scale)."""

    def __init__(self, weight: torch.Tensor, group: int, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.group = group
        self.bias = None if bias is None else bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = torch.cat([token_fp8(p) for p in x.float().split(self.group, dim=-1)], dim=-1)
        return nn.functional.linear(xq.to(x.dtype), self.weight, self.bias)


def _ct_module(group: dict, t: dict, bias, module: str) -> nn.Module:
    wargs, aargs = group.get("weights") or {}, group.get("input_activations")
    strategy = wargs.get("strategy")
    if "weight_packed" in t:
        if "weight_shape" not in t:
            raise CheckpointError(f"tensor '{module}.weight_shape' is missing (compressed-tensors pack-quantized)")
        out_f, in_f = (int(x) for x in t["weight_shape"].reshape(-1).tolist())
        gs = wargs.get("group_size") if strategy in ("group", "tensor_group") else None
        w = dequant.pack_quantized(t, module, out_f, in_f, gs, bool(wargs.get("symmetric", True)))
    elif strategy == "block":
        w = dequant.fp8_block(t, module, tuple(wargs.get("block_structure") or (128, 128)), "weight_scale")
    elif "weight" in t and t["weight"].dtype == torch.int8:
        w = dequant.int8_channel(t, module, *t["weight"].shape)
    else:
        if "weight_scale" not in t:
            raise CheckpointError(f"tensor '{module}.weight_scale' is missing (compressed-tensors)")
        ws = t["weight_scale"].float()
        w = t["weight"].float() * (ws.reshape(-1, 1) if ws.numel() > 1 else ws.reshape(()))
    if aargs is None:
        return QuantLinear(w, bias=bias)
    if aargs.get("dynamic"):
        kind = (aargs.get("type"), aargs.get("strategy"))
        if kind == ("float", "token"):
            return TokenFP8Linear(w, bias)
        if kind == ("int", "token"):
            return TokenInt8Linear(w, INT8_TOKEN_DIVISOR["compressed-tensors"], bias)
        if kind == ("float", "group"):
            return GroupFP8Linear(w, int(aargs.get("group_size") or 128), bias)
        raise CheckpointError(f"config.json: dynamic {kind[0]} activations per {kind[1]!r} are not supported")
    if "input_scale" not in t:
        raise CheckpointError(f"tensor '{module}.input_scale' is missing (compressed-tensors static activations)")
    return QuantLinear(w, None, t["input_scale"].float().reshape(1), "fp8", bias)


# --- GPTQ, AutoAWQ, FP8 block, fbgemm FP8 -----------------------------------------------------------------


def _gptq_module(qc: dict, t: dict, bias, module: str) -> nn.Module:
    v1 = str(qc.get("checkpoint_format", qc.get("format", "gptq"))) == "gptq"
    if int(qc.get("bits", 4)) != 4:
        raise CheckpointError(f"config.json: quantization_config.bits {qc.get('bits')} (GPTQ 4-bit only)")
    b = None if bias is None or not bool(bias.any()) else bias
    return QuantLinear(dequant.gptq(t, module, v1, qc.get("group_size")), bias=b)


def _awq_module(qc: dict, t: dict, bias, module: str) -> nn.Module:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or int(qc.get("bits", 4)) != 4:
        raise CheckpointError(f"config.json: AutoAWQ {version} {qc.get('bits')}-bit is not supported (GEMM 4-bit)")
    return QuantLinear(dequant.awq_gemm(t, module, int(qc.get("group_size", 128))), bias=bias)


def _fp8_block_module(qc: dict, t: dict, bias, module: str) -> nn.Module:
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size is {block!r} (two integers)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"config.json: quantization_config.activation_scheme "
            f"{qc.get('activation_scheme')!r} is not supported (dynamic)"
        )
    return GroupFP8Linear(dequant.fp8_block(t, module, tuple(block)), int(block[1]), bias)


def _fbgemm_module(qc: dict, t: dict, bias, module: str) -> nn.Module:
    return TokenFP8Linear(dequant.fp8_rowwise(t, module), bias, float(qc.get("activation_scale_ub", 1200.0)))


# quant_method -> (builds a quantized module, is this HF module stored quantized?)
OTHER_FORMATS = {
    "gptq": (_gptq_module, lambda t: "qweight" in t),
    "awq": (_awq_module, lambda t: "qweight" in t),
    "fp8": (_fp8_block_module, lambda t: t.get("weight") is not None and t["weight"].dtype == torch.float8_e4m3fn),
    "fbgemm_fp8": (_fbgemm_module, lambda t: t.get("weight") is not None and t["weight"].dtype == torch.float8_e4m3fn),
}


# --- loading ------------------------------------------------------------------------------------------------


class _Reader:
    """All tensors of ``model.safetensors`` or its shards, read on demand."""

    def __init__(self, d: Path):
        index = d / "model.safetensors.index.json"
        files = sorted(set(load_json(index)["weight_map"].values())) if index.exists() else ["model.safetensors"]
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
        return {
            k[len(prefix) :]: self.get(k) for k in self.where if k.startswith(prefix) and "." not in k[len(prefix) :]
        }


def quant_scheme(d: Path, cfg: dict) -> tuple[str, dict]:
    """("none" | "modelopt" | "compressed-tensors" | a key of :data:`OTHER_FORMATS`, the config dict that
    describes it)."""
    hq = d / "hf_quant_config.json"
    if hq.exists():  # authoritative when present (TensorRT-LLM's rule)
        return "modelopt", load_json(hq)["quantization"]
    qc = cfg.get("quantization_config")
    if not qc:
        return "none", {}
    method = str(qc.get("quant_method", ""))
    if method == "mxfp4":  # experts only (gpt-oss as shipped); their rules decode them, every linear is plain
        return "none", {}
    if method.startswith("modelopt"):
        return "modelopt", {
            "quant_algo": qc.get("quant_algo"),
            "exclude_modules": qc.get("ignore", []),
            "kv_cache_quant_algo": "FP8" if qc.get("kv_cache_scheme") else None,
        }
    if method == "compressed-tensors":
        return "compressed-tensors", qc
    if method in OTHER_FORMATS:
        return method, qc
    raise CheckpointError(f"{d / 'config.json'}: quantization_config.quant_method '{method}' is not supported")


def load_hf_checkpoint(model_dir: str | Path) -> ReferenceModel:
    """Build the reference model of an HF checkpoint directory of any family trtpipe converts, quantized or not
    (MoE experts as modules of their own, as ModelOpt writes them)."""
    return _HFBuild(Path(model_dir)).model()


def load_hf_layer(model_dir: str | Path, i: int) -> tuple[DecoderLayer, dict[str, torch.Tensor]]:
    """Decoder layer ``i`` of an HF checkpoint, built as :func:`load_hf_checkpoint` builds its own, even past
    ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer ``model.layers.{num_hidden_layers}``), and that
    layer's other tensors named relative to the layer: norms float32 (``enorm.weight``), projections as modules
    dequantized as the layer's own (``eh_proj``)."""
    b = _HFBuild(Path(model_dir))
    pre = b.names.prefix.format(i)
    own = {k[len(pre) :] for k in b.r.where if k.startswith(pre)}
    layer, used = b.layer(i)
    extra = {}
    for k in sorted(own - used):
        module, leaf = k.rsplit(".", 1)
        if leaf == "weight" and k.endswith("_proj.weight"):  # a projection (eh_proj): quantized as the layer's are
            extra[module] = b.linear(pre + module)
        elif leaf in ("weight", "bias"):
            extra[k] = b.r.get(pre + k).float()
    return layer, extra


class _HFBuild:
    """What building a checkpoint's layers needs: its config, quantization scheme, names and tensors."""

    def __init__(self, d: Path):
        from trtpipe.checkpoint.convert import make_plan
        from trtpipe.checkpoint.hf_names import HFNames

        self.d = d
        cfg = load_json(d / "config.json")
        self.scheme, self.q = quant_scheme(d, cfg)
        self.names = HFNames(d)
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        self.trt_cfg = dict(make_plan(d, tp=1, dtype=dtype).config)
        self.kv_algo = self.q.get("kv_cache_quant_algo") if self.scheme == "modelopt" else None
        if self.kv_algo not in (None, "FP8"):
            raise CheckpointError(f"{d}: kv_cache_quant_algo {self.kv_algo!r} is not supported (FP8 only)")
        self.trt_cfg["quantization"] = {"quant_algo": None, "kv_cache_quant_algo": self.kv_algo}
        self.args = ModelArgs.from_config(self.trt_cfg)
        self.r = _Reader(d)
        self.rope = self.args.ropes()

    def model(self) -> ReferenceModel:
        layers = [self.layer(i)[0] for i in range(self.args.num_layers)]
        r, names, q = self.r, self.names, self.q
        embedding = r.get(names.globals["transformer.vocab_embedding.weight"]).float()
        ln_f = names.from_hf("transformer.ln_f.weight", r.get(names.globals["transformer.ln_f.weight"]))
        head_name = names.globals.get("lm_head.weight", "lm_head.weight")
        head = r.get(head_name).float() if head_name in r else embedding
        trt_cfg = self.trt_cfg
        trt_cfg["hf_quantization"] = {
            "scheme": self.scheme,
            **({"quant_algo": q.get("quant_algo")} if self.scheme == "modelopt" else {}),
        }
        return ReferenceModel(trt_cfg, self.args, embedding, layers, ln_f, [Float32Linear(head)])

    @staticmethod
    def excluded(module: str, patterns: list[str]) -> bool:
        import fnmatch

        return any(
            module == p
            or fnmatch.fnmatchcase(module, p)
            or p.startswith("re:")
            and __import__("re").fullmatch(p[3:], module)
            for p in patterns
        )

    def linear(self, module: str, row: bool = False) -> nn.Module:
        """``row``: a row-parallel projection, whose bias the decoder layer adds itself after the all-reduce."""
        d, scheme, q, r = self.d, self.scheme, self.q, self.r
        t = r.module(module + ".")
        bias = None if row else _f(t.get("bias"))
        algo = q.get("quant_algo") if scheme == "modelopt" else None
        if algo == "MIXED_PRECISION":  # one quant_algo per module (MXFP4 experts as shipped beside FP8 attention)
            algo = (q.get("quantized_layers") or {}).get(module, {}).get("quant_algo")
        if algo and not self.excluded(module, q.get("exclude_modules", [])):
            return _modelopt_module(algo, t, bias)
        if scheme == "compressed-tensors" and not self.excluded(module, q.get("ignore", [])):
            group = next((g for g in q["config_groups"].values() if "Linear" in g.get("targets", [])), None)
            if group is not None:
                return _ct_module(group, t, bias, module)
        if scheme in OTHER_FORMATS and OTHER_FORMATS[scheme][1](t):
            return OTHER_FORMATS[scheme][0](q, t, bias, module)
        if "weight" not in t:
            raise CheckpointError(f"{d}: tensor '{module}.weight' is missing")
        if not t["weight"].is_floating_point() or t["weight"].dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"{d}: '{module}.weight' is {t['weight'].dtype} but the module is not quantized")
        return Float32Linear(t["weight"].float(), bias)

    def layer(self, i: int) -> tuple[DecoderLayer, set[str]]:
        """Layer ``i`` and the names (relative to its HF prefix) of the tensors it was built from."""
        from trtpipe.checkpoint.convert import COMBINERS

        names, r, args, kv_algo = self.names, self.r, self.args, self.kv_algo
        used: set[str] = set()

        def build(module: str, row: bool = False) -> nn.Module:
            used.update(
                k[len(pre) :] for k in r.where if k.startswith(module + ".") and "." not in k[len(module) + 1 :]
            )
            return self.linear(module, row)

        tensors: dict[str, torch.Tensor] = {}
        modules: dict[str, nn.Module] = {}
        pre = names.prefix.format(i)
        experts: dict[str, list[nn.Module]] = {}  # stacked-expert linear -> one module per expert
        for trt_rel, parts in names.layer.items():
            if not names.in_layer(trt_rel, i):
                continue
            if trt_rel in names.fused:  # fused experts (gpt-oss; MXFP4 decoded): the conversion's own combine
                rule = names.fused[trt_rel]
                used.update(rule.hf)
                tensors[trt_rel] = COMBINERS[rule.combine]([[r.get(pre + h)] for h in rule.hf]).float()
                continue
            if trt_rel in names.experts:  # MoE: each expert's projections are modules of their own
                linear = trt_rel.rsplit(".", 1)[0]
                mods = [
                    [build(pre + h.format(e=e).rsplit(".", 1)[0]) for h, _ in parts] for e in range(args.num_experts)
                ]
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
                used.update(h for h, _ in parts)
                tensors[trt_rel] = names.from_hf(trt_rel, torch.cat([r.get(h).float() for h in hf_full], dim=0))
        if kv_algo:
            tensors["attention.kv_cache_scaling_factor"] = torch.ones(1)
        layer = DecoderLayer(args, [tensors], i, self.rope)
        for linear, module in modules.items():
            owner, attr = _LINEAR_ATTR[linear]
            setattr(getattr(layer, owner)[0], attr, module)
        for linear, mods in experts.items():  # fc = [up; gate] of each expert, proj = its down_proj
            setattr(layer.mlp[0], linear.split(".")[1], nn.ModuleList(mods))
        return layer, used


# TRT-LLM linear -> (DecoderLayer attribute holding the shard list, attribute of the shard)
_LINEAR_ATTR = {
    "attention.qkv": ("attention", "qkv"),
    "attention.dense": ("attention", "dense"),
    "mlp.fc": ("mlp", "fc"),
    "mlp.gate": ("mlp", "gate"),
    "mlp.proj": ("mlp", "proj"),
    # DeepSeek-V3 (trtpipe.runtime.mla): latent attention's projections, the dense first layers, the shared experts
    "attention.q_a": ("attention", "q_a"),
    "attention.q_b": ("attention", "q_b"),
    "attention.q": ("attention", "q"),
    "attention.kv_a": ("attention", "kv_a"),
    "attention.kv_b": ("attention", "kv_b"),
    "ffn.fc": ("mlp", "fc"),
    "ffn.gate": ("mlp", "gate"),
    "ffn.proj": ("mlp", "proj"),
    "mlp.shared_expert.fc": ("shared", "fc"),
    "mlp.shared_expert.gate": ("shared", "gate"),
    "mlp.shared_expert.proj": ("shared", "proj"),
}


_ROW = (
    "attention.dense",
    "mlp.proj",
    "ffn.proj",
    "mlp.shared_expert.proj",
)  # row-parallel: biases added once by the layer (DecoderLayer.dense_bias ...)


def _weight_of(m: nn.Module) -> torch.Tensor:
    return m.weight.detach()


def is_trtllm_checkpoint(model_dir: str | Path) -> bool:
    """A TensorRT-LLM checkpoint directory (``rank*.safetensors``), not a Hugging Face one."""
    return any(Path(model_dir).glob("rank*.safetensors"))


def load_model(model_dir: str | Path) -> ReferenceModel:
    """The reference model of either kind of directory: a TensorRT-LLM checkpoint (what the engine target builds
    from) or an HF checkpoint as stored (what the llmapi target serves). The one loader the accuracy report and
    the ``self`` eval samples use, so both targets are measured on what they deploy."""
    return load_checkpoint(model_dir) if is_trtllm_checkpoint(model_dir) else load_hf_checkpoint(model_dir)
