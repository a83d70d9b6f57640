"""Write ModelOpt's unified HF checkpoint (what TensorRT-LLM's PyTorch backend calls "pre-quantized") from the
unquantized checkpoint and the calibration statistics already collected: no recalibration.

Layer by layer: the unsharded float tensors of one layer (TRT-LLM names, from the checkpoint artifact), the
same quantization parameters the engine path computes (:func:`trtpipe.quant.quantize.layer_params`), then the
fused q/k/v and gate/up of TRT-LLM split back into the HF projections by the architecture's own mapping rules,
renamed and stored as :mod:`trtpipe.export.formats` says. Each finished layer goes to a part file; the shards
(``model-0000x-of-0000y.safetensors`` + index, or one ``model.safetensors``) are then assembled one tensor at a
time, so host memory stays one layer whatever the model size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file

from trtpipe.checkpoint.convert import TOKENIZER_FILES
from trtpipe.checkpoint.hf_names import HFNames
from trtpipe.checkpoint.quant_layouts import ALGOS, LINEAR_GROUPS, LINEARS
from trtpipe.formats.primitives import (
    NVFP4_BLOCK,
    choose_qparams,
    nvfp4_quantize,
    observe_amax,
    pack_int4_rows,
    quantize,
)
from trtpipe.checkpoint.writer import RankFile
from trtpipe.errors import QuantizationError
from trtpipe.formats.schemes import needs_calibration_data
from trtpipe.export.formats import (
    HF_FORMATS,
    MOE_EXPORT_ALGOS,
    SCALARS,
    SUFFIX,
    hf_quant_config,
    inline_quantization_config,
)
from trtpipe.models.dims import read_hf_config
from trtpipe.models.hfconfig import nested_rope
from trtpipe.quant.calibrate import load_layer_stats
from trtpipe.quant.quantize import TORCH_DTYPES, layer_params
from trtpipe.quant.writer import TrtllmSource, excluded_fn, read_tensors
from trtpipe.jsonfile import load_json

HF_QUANT_CONFIG = "hf_quant_config.json"
INDEX = "model.safetensors.index.json"
# the RMSNorm in front of each fused group, where AWQ's pre-quant scale folds (TRT-LLM names). In a model with
# inter_layernorms (Gemma) post_layernorm normalizes the attention output and pre_feedforward_layernorm is the one
# in front of the MLP: the first name a layer has is the one.
NORM_BEFORE = {
    "attention.qkv": ("input_layernorm.weight",),
    "mlp.fc+gate": ("pre_feedforward_layernorm.weight", "post_layernorm.weight"),
}
ROW_KEYS = ("weight", "weights_scaling_factor")  # indexed by output row: split with q/k/v
_GROUP_OF = {m: g for g, (members, _) in LINEAR_GROUPS.items() for m in members}


def producer() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("trtpipe")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        v = "0"
    return {"name": "trtpipe", "version": v}


def _hf_linear(
    fmt_algo: str, p: dict[str, torch.Tensor], fold: bool, group_size: int, model_dtype: torch.dtype, own_scale: bool
) -> dict[str, torch.Tensor]:
    """One HF projection's stored tensors from its (row-split) float parameters."""
    algo = ALGOS[HF_FORMATS[fmt_algo].base]
    w = p["weight"]
    gran = group_size if algo.granularity == "group" else algo.granularity
    ws = p["weights_scaling_factor"]
    if own_scale:  # FP8: every projection its own per-tensor scale (the loader re-quantizes fused ones to the max)
        ws = choose_qparams(observe_amax(w, "tensor"), algo.weight_fmt)
    if gran == "tensor" and algo.weight_fmt == "fp8":
        # ModelOpt divides the model-dtype weight by a 0-d float32 scale, which stays in the model dtype: the
        # quotient is rounded to it before the FP8 cast. Same here, so the codes are ModelOpt's bit for bit.
        q = quantize((w.to(model_dtype) / ws.reshape(())).float(), torch.ones(1), "fp8", "tensor")
    else:
        q = quantize(w, ws, algo.weight_fmt, gran)
    if algo.weight_fmt == "int4":
        q = pack_int4_rows(q).view(torch.uint8)
    out = {"weight": q.contiguous(), "weight_scale": (ws.reshape(()) if gran == "tensor" else ws).float()}
    for key in ("activation_scaling_factor", "weights_scaling_factor_2"):
        if key in p:
            out[SUFFIX[key]] = p[key].float().reshape(())
    if "prequant_scaling_factor" in p and not fold:
        out["pre_quant_scale"] = p["prequant_scaling_factor"].to(model_dtype)
    return out


def _nvfp4(w: torch.Tensor, wsf2: torch.Tensor, input_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4: E2M1 codes packed two per byte along the input (low nibble = even column), FP8 block scales, F32
    second-level scale wsf2 = amax/(6*448) (shared by fused members) and input_scale = amax(x)/(6*448)."""
    packed, bs = nvfp4_quantize(w, wsf2)
    return {
        "weight": packed,
        "weight_scale": bs,
        "weight_scale_2": wsf2.float().reshape(()),
        "input_scale": input_scale.float().reshape(()),
    }


def _nvfp4_params(weights: dict, stats, excluded) -> dict:
    """Per TRT-LLM linear: the weight, the group's shared wsf2 and input scale (the loader asserts them equal)."""
    out = {}
    for group, (members, _) in LINEAR_GROUPS.items():
        members = [m for m in members if m in weights and not excluded(m)]
        if not members:
            continue
        ws = [weights[m].float() for m in members]
        for m, w in zip(members, ws):
            if w.shape[-1] % NVFP4_BLOCK:
                raise QuantizationError(
                    f"{m}: in_features {w.shape[-1]} is not a multiple of 16 (NVFP4 blocks); "
                    f"add '*{m}' to quantization.exclude"
                )
        wsf2 = torch.stack([w.abs().amax() for w in ws]).amax() / (6.0 * 448.0)
        in_scale = stats.groups[group].amax.amax() / (6.0 * 448.0)
        for m, w in zip(members, ws):
            out[m] = {"weight": w, "nvfp4": (wsf2, in_scale)}
    return out


def _fp8_rowwise(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """FP8_PER_CHANNEL_PER_TOKEN: per-output-row weight scale, activations quantized per token at run time."""
    ws = choose_qparams(observe_amax(w, "channel"), "fp8")
    return {"weight": quantize(w, ws, "fp8", "channel").contiguous(), "weight_scale": ws}


def layer_tensors(
    names: HFNames,
    tensors: dict[str, torch.Tensor],
    i: int,
    algo: str,
    stats,
    group_size: int,
    alpha: float,
    exclude: list[str],
    model_dtype: str,
    kv_cache: str,
) -> tuple[dict, list[str]]:
    """HF tensors of decoder layer ``i`` and the HF modules left unquantized (for exclude_modules)."""
    dt = TORCH_DTYPES[model_dtype]
    fmt = HF_FORMATS.get(algo)
    excluded = excluded_fn(exclude, i)
    weights = {
        m: tensors[f"{m}.weight"]
        for m in LINEARS
        if f"{m}.weight" in tensors and f"{m}.weight" not in names.experts and f"{m}.weight" not in names.fused
    }
    if fmt is None:
        params = {}
    elif algo == "nvfp4":
        params = _nvfp4_params(weights, stats, excluded)
    elif fmt.base is None:
        params = {m: {"weight": w} for m, w in weights.items() if not excluded(m)}
    else:
        params = layer_params(ALGOS[fmt.base], weights, stats, group_size, alpha, excluded, model_dtype)
    tensors = dict(tensors)
    for group, candidates in NORM_BEFORE.items():  # fold the group's pre-quant scale into the norm before it
        member = LINEAR_GROUPS[group][0][0]
        pqs = params.get(member, {}).get("prequant_scaling_factor")
        norm = next((n for n in candidates if n in tensors), candidates[-1])
        if pqs is not None:
            tensors[norm] = tensors[norm].float() * pqs.float()
    out: dict[str, torch.Tensor] = {}
    unquantized: list[str] = []
    for rel, t in tensors.items():
        linear = rel.rsplit(".", 1)[0]
        if rel in names.fused:  # gpt-oss experts: as the source holds them (MXFP4 as shipped), never re-quantized
            out.update(names.fused_to_hf(rel, t, i, dt))
            continue
        if rel in names.experts and fmt is not None and not excluded(linear):
            out.update(_expert_tensors(names, rel, t, i, algo, stats, group_size, dt))
            continue
        if linear in params and rel.endswith(".weight"):
            p = params[linear]
            fold = _GROUP_OF[linear] in NORM_BEFORE
            rows = [n for _, n in names.layer[rel]]
            pieces = {
                k: (
                    v.split(rows, dim=0)
                    if k in ROW_KEYS and v.dim() >= 1 and v.shape[0] == t.shape[0]
                    else [v] * len(rows)
                )
                for k, v in p.items()
            }
            for j, (hf_name, _) in enumerate(names.split(rel, t, i)):
                module = hf_name.rsplit(".", 1)[0]
                pj = {k: v[j] for k, v in pieces.items()}
                if "nvfp4" in pj:
                    stored = _nvfp4(pj["weight"], *pj["nvfp4"])
                elif fmt.base is None:
                    stored = _fp8_rowwise(pj["weight"])
                else:
                    stored = _hf_linear(algo, pj, fold, group_size, dt, fmt.own_weight_scale)
                out.update({f"{module}.{k}": v for k, v in stored.items()})
            continue
        for hf_name, piece in names.split(rel, t, i):
            out[hf_name] = piece.to(dt)
        if rel.endswith(".weight") and (linear in weights or rel in names.experts or linear == "mlp.router"):
            unquantized += [n.rsplit(".", 1)[0] for n, _ in names.split(rel, t, i)]  # the router stays unquantized
    if kv_cache != "none":
        pre = names.prefix.format(i)
        out[f"{pre}self_attn.k_proj.k_scale"] = choose_qparams(stats.k_amax.reshape(()), "fp8")
        out[f"{pre}self_attn.v_proj.v_scale"] = choose_qparams(stats.v_amax.reshape(()), "fp8")
    for k in list(out):
        if k.rsplit(".", 1)[1] in SCALARS:
            out[k] = out[k].reshape(())
    return out, unquantized


def _expert_tensors(
    names: HFNames, rel: str, t: torch.Tensor, i: int, algo: str, stats, group_size: int, dt: torch.dtype
) -> dict[str, torch.Tensor]:
    """One MoE linear's experts as ModelOpt writes them: every expert's projections quantized on their own.

    Every expert's input scale is static, from the max |x| of the tokens calibration routed to that expert
    (:meth:`GroupStats.expert_input_amax`, with its stated fallback for an expert no token reached); up_proj and
    gate_proj read the same input, so they share it.

    An expert's up_proj and gate_proj are one fused gate_up GEMM: they share the weight's per-tensor scale (FP8:
    ``weight_scale``; NVFP4: the second-level ``weight_scale_2`` over per-projection FP8 block scales), down_proj
    has its own, as ModelOpt 0.47's ``_QuantFusedExperts`` writes them. ModelOpt 0.47 on transformers 5's fused experts
    shares one input scale across all experts of a layer instead; TensorRT-LLM's fused MoE takes the maximum over
    the experts, which is the same number when every expert saw a token.
    """
    if algo not in MOE_EXPORT_ALGOS:
        raise QuantizationError(
            f"layer {i} {rel}: quantization.algo {algo} is not exported for MoE experts "
            f"(supported: {', '.join(MOE_EXPORT_ALGOS)})"
        )
    amax = stats.groups[_GROUP_OF[rel.rsplit(".", 1)[0]]].expert_input_amax()  # [E]
    pieces = names.split(rel, t, i)
    per_expert = len(pieces) // t.shape[0]
    out: dict[str, torch.Tensor] = {}
    if algo == "nvfp4":
        for e in range(t.shape[0]):
            mine = [(n, w.float()) for n, w in pieces[e * per_expert : (e + 1) * per_expert]]
            wsf2 = torch.stack([w.abs().amax() for _, w in mine]).amax() / (6.0 * 448.0)
            for hf_name, w in mine:
                if w.shape[-1] % NVFP4_BLOCK:
                    raise QuantizationError(
                        f"{hf_name}: in_features {w.shape[-1]} is not a multiple of 16 (NVFP4 "
                        f"blocks); add '*{rel.rsplit('.', 1)[0]}' to quantization.exclude"
                    )
                stored = _nvfp4(w, wsf2, amax[e] / (6.0 * 448.0))
                out.update({f"{hf_name.rsplit('.', 1)[0]}.{s}": v for s, v in stored.items()})
        return out
    if algo == "w4a8_awq":
        return _expert_w4a8_tensors(names, rel, t, stats, group_size, dt, [n for n, _ in pieces])
    for k, (hf_name, w) in enumerate(pieces):
        w = w.float()
        mine = pieces[k // per_expert * per_expert : (k // per_expert + 1) * per_expert]  # up and gate share it
        ws = choose_qparams(torch.stack([observe_amax(v.float(), "tensor").reshape(()) for _, v in mine]).amax(), "fp8")
        p = {
            "weight": w,
            "weights_scaling_factor": ws.reshape(1),
            "activation_scaling_factor": choose_qparams(amax[k // per_expert].reshape(1), "fp8"),
        }
        stored = _hf_linear(algo, p, False, group_size, dt, own_scale=False)
        out.update({f"{hf_name.rsplit('.', 1)[0]}.{s}": v for s, v in stored.items()})
    return out


# a W4A8 expert's per-tensor scales ([E, 1] in layer_params): one per expert, shared by its projections
PER_EXPERT = ("weights_scaling_factor_2", "activation_scaling_factor")


def _expert_w4a8_tensors(
    names: HFNames, rel: str, t: torch.Tensor, stats, group_size: int, dt: torch.dtype, hf_names: list[str]
) -> dict[str, torch.Tensor]:
    """W4A8_AWQ experts, each projection a W4A8 AWQ linear of its own, as ModelOpt 0.47 writes a dense one (packed
    int4 ``weight`` [out/2, in] U8, full per-group ``weight_scale`` [out, in/g] F32, ``weight_scale_2`` F32 [] =
    amax(W / pqs) / 448, ``input_scale`` F32 [] = amax(x * pqs) / 448, ``pre_quant_scale`` [in] in the model dtype,
    never folded: the norm before the experts is shared by all of them).

    The scales are the engine path's (:func:`layer_params` on the stacked experts): the layer's shared pre-quant
    scale, each expert's clipped group amax, its own ``weight_scale_2`` (shared by its gate_proj and up_proj, one
    fused GEMM) and its own ``input_scale`` from the tokens routed to it (:meth:`GroupStats.expert_smoothed_amax`,
    with its fallback for an expert no token reached); TensorRT-LLM's loader takes the max of gate's and up's, the
    same number."""
    linear = rel.rsplit(".", 1)[0]
    model_dtype = next(k for k, v in TORCH_DTYPES.items() if v == dt)
    p = layer_params(ALGOS["w4a8_awq"], {linear: t}, stats, group_size, 0.0, lambda m: False, model_dtype)[linear]
    sizes = [n for _, n in names.layer[rel]]
    pqs = p["prequant_scaling_factor"]  # the layer's, every expert's
    pieces = (
        {"weight": w, "weights_scaling_factor": s, "prequant_scaling_factor": pqs, **{k: p[k][e] for k in PER_EXPERT}}
        for e in range(t.shape[0])
        for w, s in zip(p["weight"][e].split(sizes), p["weights_scaling_factor"][e].split(sizes))
    )
    out: dict[str, torch.Tensor] = {}
    for hf_name, q in zip(hf_names, pieces):
        stored = _hf_linear("w4a8_awq", q, False, group_size, dt, own_scale=False)
        out.update({f"{hf_name.rsplit('.', 1)[0]}.{k}": v for k, v in stored.items()})
    return out


def global_tensors(source: TrtllmSource, names: HFNames, dt: torch.dtype) -> dict[str, torch.Tensor]:
    """Embedding, final norm and (untied) lm_head, un-padded and un-split from the checkpoint."""
    a = source.full
    out = {names.globals["transformer.vocab_embedding.weight"]: source.embedding().to(dt)}
    last = a.pp - 1
    ranks = source.ranks(last, ("transformer.ln_f.", "lm_head."))
    ln_f = names.to_hf(
        "transformer.ln_f.weight", ranks[0]["transformer.ln_f.weight"], names.globals["transformer.ln_f.weight"]
    )
    out[names.globals["transformer.ln_f.weight"]] = ln_f.to(dt)
    if "lm_head.weight" in names.globals:
        head = torch.cat([r["lm_head.weight"] for r in ranks], dim=0) if a.tp > 1 else ranks[0]["lm_head.weight"]
        out[names.globals["lm_head.weight"]] = head[: names.info.vocab_size].to(dt)
    return out


def hf_config(hf_dir: Path, model_dtype: str, quantization_config: Optional[dict]) -> dict:
    """The model's config.json in both transformers spellings (4.x reads ``rope_theta``/``torch_dtype``, 5.x
    ``rope_parameters``/``dtype``; TRT-LLM 1.1/1.2 pin 4.57), plus the inline quantization_config."""
    cfg = load_json(hf_dir / "config.json")
    cfg["dtype"] = cfg["torch_dtype"] = model_dtype
    info = read_hf_config(hf_dir)
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    if text is not cfg or nested_rope(cfg) is not None:
        # a multimodal config, or per-layer-type rope (Gemma 3): kept as written, plus the transformers-4 keys of
        # each layer type's rope (4.x Gemma3TextConfig reads rope_theta, rope_local_base_freq and rope_scaling and
        # ignores rope_parameters: without them a 4.57 reader would drop the global layers' linear scaling)
        nested = nested_rope(text)
        if nested is not None:
            full, local = nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
            text["rope_theta"] = full.get("rope_theta", info.rope_theta)
            if "rope_theta" in local:
                text["rope_local_base_freq"] = local["rope_theta"]
            if info.rope_scaling:
                text["rope_scaling"] = {**info.rope_scaling, "rope_type": info.rope_scaling.get("rope_type", "linear")}
        cfg.pop("quantization_config", None)
        if quantization_config is not None:
            cfg["quantization_config"] = quantization_config
        return cfg
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope.setdefault("rope_theta", info.rope_theta)
    rope.setdefault("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
    cfg["rope_parameters"], cfg["rope_theta"] = rope, info.rope_theta
    if scaling:
        cfg["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    return cfg


def export_unified(
    ckpt_dir: Path,
    hf_dir: Path,
    stats_dir: Optional[Path],
    out_dir: Path,
    *,
    algo: str,
    kv_cache: str,
    group_size: int,
    alpha: float,
    exclude: list[str],
    max_shard_bytes: int = 10 * 10**9,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Write the unified HF checkpoint of ``ckpt_dir`` (unquantized TRT-LLM checkpoint, any tp/pp) into ``out_dir``.

    Args:
        hf_dir: the source HF model (its config.json; the mapping rules of its architecture).
        stats_dir: the calibration artifact (None when nothing needs data).
        algo / kv_cache / group_size / alpha / exclude: the recipe's quantization (exclude in TRT-LLM names).

    Returns:
        The hf_quant_config.json dict (``quant_algo`` None for an unquantized export).
    """
    source = TrtllmSource(ckpt_dir)
    names = HFNames(hf_dir)
    if names.info.is_moe and algo not in MOE_EXPORT_ALGOS:
        raise QuantizationError(
            f"{hf_dir}: quantization.algo {algo} is not exported for mixture-of-experts models "
            f"(supported: {', '.join(MOE_EXPORT_ALGOS)})"
        )
    if algo != "none" and algo not in HF_FORMATS:
        raise QuantizationError(
            f"quantization.algo: {algo} has no unified HF format (supported: {', '.join(HF_FORMATS)})"
        )
    needs_stats = needs_calibration_data(algo, kv_cache)
    if needs_stats and stats_dir is None:
        raise QuantizationError(f"quantization.algo={algo} kv_cache={kv_cache} needs calibration statistics")
    model_dtype = source.args.dtype
    dt = TORCH_DTYPES[model_dtype]
    unquantized: list[str] = []
    quantized_modules: list[str] = []  # HF modules written with a weight scale (quantized per the recipe)
    with ShardParts(out_dir, max_shard_bytes) as parts:
        parts.add("globals", global_tensors(source, names, dt))
        for i in range(source.args.num_layers):
            if progress:
                progress(f"({i + 1}/{source.args.num_layers}) Exporting")
            stats = load_layer_stats(stats_dir, i) if needs_stats else None
            out, unq = layer_tensors(
                names, source.layer(i), i, algo, stats, group_size, alpha, exclude, model_dtype, kv_cache
            )
            unquantized += unq
            quantized_modules += sorted({k.rsplit(".", 1)[0] for k in out if k.endswith(".weight_scale")})
            parts.add(f"layer{i}", out)
            del out
    quantized = algo != "none" or kv_cache != "none"
    embedding = names.globals["transformer.vocab_embedding.weight"].rsplit(".", 1)[0]
    exclude_modules = sorted(
        ["lm_head"] + ([embedding] if names.embedding_excluded else []) + (unquantized if algo != "none" else [])
    )
    hq = hf_quant_config(algo, kv_cache, group_size, exclude_modules, producer())
    shipped = names.shipped_quantization
    inline = inline_quantization_config(hq) if quantized else None
    if shipped is not None:
        # config.json keeps the hub's mxfp4 quantization_config: alone, TensorRT-LLM reads the experts from it; with
        # modules the recipe quantized, hf_quant_config.json (which TensorRT-LLM prefers) holds one entry per module
        inline = shipped
        if quantized:
            hq = mixed_precision(
                hq, quantized_modules, [f"{names.prefix.format(i)}mlp.experts" for i in range(source.args.num_layers)]
            )
            (out_dir / QUANT_CFG).write_text(
                json.dumps(
                    {k: hq["quantization"][k] for k in ("quant_algo", "kv_cache_quant_algo", "quantized_layers")},
                    indent=4,
                )
                + "\n"
            )
    (out_dir / "config.json").write_text(json.dumps(hf_config(hf_dir, model_dtype, inline), indent=2) + "\n")
    if quantized:
        (out_dir / HF_QUANT_CONFIG).write_text(json.dumps(hq, indent=4) + "\n")
    for name in TOKENIZER_FILES:  # trtllm-serve reads the tokenizer from the model directory
        if (ckpt_dir / name).is_file():
            shutil.copyfile(ckpt_dir / name, out_dir / name)
    return hq


QUANT_CFG = "quant_cfg.json"
MXFP4_EXPERTS = {"quant_algo": "W4A16_MXFP4", "group_size": 32}


def mixed_precision(hq: dict, quantized: list[str], mxfp4_experts: list[str]) -> dict:
    """hf_quant_config.json for MXFP4 experts as shipped beside modules the recipe quantized: TensorRT-LLM's
    ``MIXED_PRECISION`` with a ``quantized_layers`` entry per module (the recipe's quant_algo for the quantized ones,
    ``W4A16_MXFP4`` with group 32 for each layer's experts), also written to quant_cfg.json (1.0-era loaders read it
    from there). That TensorRT-LLM 1.2 loads this pairing for gpt-oss was derived from its quant-config reader, not
    run; a W4A8_MXFP4_* activation mode (Blackwell) is chosen by TensorRT-LLM only from a config.json-only mxfp4
    checkpoint, i.e. the unquantized export."""
    q = dict(hq["quantization"])
    algo = q.pop("quant_algo")
    layers = {m: {"quant_algo": algo} for m in quantized} if algo else {}
    layers.update({m: dict(MXFP4_EXPERTS) for m in mxfp4_experts})
    exclude = q.pop("exclude_modules")
    return {
        "producer": hq["producer"],
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            **q,
            "quantized_layers": dict(sorted(layers.items())),
            "exclude_modules": exclude,
        },
    }


class ShardParts:
    """One part file per layer (and one for the globals) under ``out_dir/.parts``, assembled into the HF shards when
    the ``with`` block ends without an error; the parts are removed either way.

    Why parts: a layer's tensors are written as soon as they are made, so an export holds one layer in memory, and
    the final shards (sorted names, transformers' size rule) are cut from the parts by reading slices.
    """

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self.dir = out_dir / ".parts"
        self.parts: list[Path] = []

    def add(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        self.parts.append(self.dir / f"{name}.safetensors")
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(self.parts[-1]))

    def __enter__(self) -> "ShardParts":
        self.dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None:
                assemble_shards(self.parts, self.out_dir, self.max_shard_bytes)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def assemble_shards(parts: list[Path], out_dir: Path, max_shard_bytes: int) -> None:
    """Part files -> ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` + index when larger than
    ``max_shard_bytes`` (transformers' rule: a tensor starts a new shard when it would overflow one)."""
    from safetensors import safe_open

    from trtpipe.quant.writer import ST_TO_TORCH

    entries, where = [], {}
    for path in parts:
        with safe_open(str(path), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                dtype, shape = ST_TO_TORCH[sl.get_dtype()], tuple(sl.get_shape())
                nbytes = dtype.itemsize * int(torch.Size(shape).numel())
                entries.append((k, dtype, shape, nbytes))
                where[k] = path
    entries.sort(key=lambda e: e[0])
    shards: list[list] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e[3] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e[3]
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map = {}
    for fname, shard in zip(files, shards):
        f = RankFile(out_dir / fname, [(k, d, s) for k, d, s, _ in shard])
        for path in dict.fromkeys(where[k] for k, *_ in shard):  # one part file read at a time
            wanted = {k for k, *_ in shard if where[k] == path}
            for k, t in read_tensors(path).items():
                if k in wanted:
                    f.write(k, t)
        f.close()
        weight_map.update({k: fname for k, *_ in shard})
    if n > 1:
        total = sum(e[3] for e in entries)
        (out_dir / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
