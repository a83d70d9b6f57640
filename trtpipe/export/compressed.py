"""Write a compressed-tensors checkpoint (vLLM, SGLang, transformers + ``compressed-tensors``) from the same
unquantized checkpoint and calibration statistics as the unified HF export.

Schemes (compressed-tensors 0.20.0 presets, per HF ``Linear``):

=========  ======================  =====================================  ====================================
recipe     scheme                  tensors                                 config_groups.group_0
=========  ======================  =====================================  ====================================
fp8        FP8 (static)            weight F8_E4M3; weight_scale [1];       W float8 tensor; A float8 tensor static
                                   input_scale [1] (model dtype)
fp8_pc_pt  FP8_DYNAMIC             weight F8_E4M3; weight_scale [out, 1]   W float8 channel; A float8 token dynamic
int4_wo    W4A16 (symmetric int4)  weight_packed I32 [out, in/8];          W int4 group (the recipe's group size)
                                   weight_scale [out, in/g]; weight_shape
=========  ======================  =====================================  ====================================

Scales are stored in the model dtype (as compressed-tensors does) and the codes are computed with the stored
scale, so dequantizing the file gives exactly what the codes mean. INT4 codes are packed eight per int32 along
the *input* dimension, offset by +8, element k at bits 4k (``pack_to_int32``); AWQ pre-quant scales have no
place in this format (see docs), so only round-to-nearest INT4 is written. KV-cache scales are not written
(``kv_cache_scheme: null``; vLLM computes FP8 KV scales itself with ``--kv-cache-dtype fp8``).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from trtpipe.checkpoint.convert import TOKENIZER_FILES
from trtpipe.checkpoint.quant_layouts import LINEAR_GROUPS, LINEARS
from trtpipe.formats.primitives import choose_qparams, observe_amax, quantize
from trtpipe.errors import QuantizationError
from trtpipe.checkpoint.hf_names import HFNames
from trtpipe.export.unified import ShardParts, global_tensors, hf_config
from trtpipe.quant.calibrate import load_layer_stats
from trtpipe.formats.dequant import pack_int4_to_int32
from trtpipe.quant.quantize import TORCH_DTYPES
from trtpipe.quant.writer import TrtllmSource, excluded_fn

log = logging.getLogger("trtpipe.export")
CT_VERSION = "0.20.0"  # the compressed-tensors release whose format this writes (and tests load with)
_GROUP_OF = {m: g for g, (members, _) in LINEAR_GROUPS.items() for m in members}


def _args(
    num_bits: int,
    typ: str,
    strategy: str,
    dynamic: bool = False,
    group_size: Optional[int] = None,
    observer: Optional[str] = None,
) -> dict:
    a = {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": group_size,
        "num_bits": num_bits,
        "observer": observer,
        "observer_kwargs": {},
        "strategy": strategy,
        "symmetric": True,
        "type": typ,
    }
    return a


# recipe algo -> (format, weights args, input_activations args, needs calibration)
SCHEMES: dict[str, tuple] = {
    "fp8": (
        "float-quantized",
        lambda g: _args(8, "float", "tensor", observer="minmax"),
        lambda g: _args(8, "float", "tensor", observer="static_minmax"),
        True,
    ),
    "fp8_pc_pt": (
        "float-quantized",
        lambda g: _args(8, "float", "channel", observer="minmax"),
        lambda g: _args(8, "float", "token", dynamic=True),
        False,
    ),
    "int4_wo": (
        "pack-quantized",
        lambda g: _args(4, "int", "group", group_size=g, observer="minmax"),
        lambda g: None,
        False,
    ),
}


def _ct_linear(
    algo: str, w: torch.Tensor, act_amax: Optional[torch.Tensor], group_size: int, dt: torch.dtype
) -> dict[str, torch.Tensor]:
    """One Linear's stored tensors; scales rounded to the model dtype first, codes computed with them."""
    if algo == "fp8":
        ws = choose_qparams(observe_amax(w, "tensor"), "fp8").to(dt)
        return {
            "weight": quantize(w, ws.float(), "fp8", "tensor"),
            "weight_scale": ws,
            "input_scale": choose_qparams(act_amax.amax().reshape(1), "fp8").to(dt),
        }
    if algo == "fp8_pc_pt":
        ws = choose_qparams(observe_amax(w, "channel"), "fp8").to(dt)
        return {"weight": quantize(w, ws.float(), "fp8", "channel"), "weight_scale": ws.reshape(-1, 1)}
    ws = choose_qparams(observe_amax(w, group_size), "int4").to(dt)
    q = quantize(w, ws.float(), "int4", group_size)
    return {
        "weight_packed": pack_int4_to_int32(q),
        "weight_scale": ws,
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def quantization_config(algo: str, group_size: int, ignore: list[str]) -> dict:
    fmt, wargs, aargs, _ = SCHEMES[algo]
    return {
        "config_groups": {
            "group_0": {
                "format": fmt,
                "input_activations": aargs(group_size),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": wargs(group_size),
            }
        },
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def export_compressed(
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
    """Write the compressed-tensors checkpoint into ``out_dir``; return its ``quantization_config``."""
    if algo not in SCHEMES:
        raise QuantizationError(
            f"quantization.algo: {algo} has no compressed-tensors scheme (supported: {', '.join(SCHEMES)})"
        )
    if kv_cache != "none":
        log.warning("compressed-tensors export: no KV-cache scales are written (vLLM: --kv-cache-dtype fp8)")
    needs_stats = SCHEMES[algo][3]
    if needs_stats and stats_dir is None:
        raise QuantizationError(f"quantization.algo={algo}: the compressed-tensors export needs calibration statistics")
    source = TrtllmSource(ckpt_dir)
    names = HFNames(hf_dir)
    dt = TORCH_DTYPES[source.args.dtype]
    ignore = ["lm_head"]
    with ShardParts(out_dir, max_shard_bytes) as parts:
        parts.add("globals", global_tensors(source, names, dt))
        for i in range(source.args.num_layers):
            if progress:
                progress(f"({i + 1}/{source.args.num_layers}) Exporting")
            stats = load_layer_stats(stats_dir, i) if needs_stats else None
            excluded = excluded_fn(exclude, i)
            out = {}
            for rel, t in source.layer(i).items():
                linear = rel.rsplit(".", 1)[0]
                pieces = names.split(rel, t, i)
                if rel.endswith(".weight") and linear in LINEARS and not excluded(linear):
                    amax = stats.groups[_GROUP_OF[linear]].amax if stats is not None else None
                    if algo == "int4_wo" and t.shape[1] % group_size:
                        raise QuantizationError(
                            f"{linear}: in_features {t.shape[1]} is not a multiple of group_size "
                            f"{group_size} (add '*{linear}' to quantization.exclude)"
                        )
                    for hf_name, w in pieces:
                        module = hf_name.rsplit(".", 1)[0]
                        out.update(
                            {f"{module}.{k}": v for k, v in _ct_linear(algo, w.float(), amax, group_size, dt).items()}
                        )
                    continue
                if rel.endswith(".weight") and linear in LINEARS:
                    ignore += [n.rsplit(".", 1)[0] for n, _ in pieces]
                out.update({n: p.to(dt) for n, p in pieces})
            parts.add(f"layer{i}", out)
            del out
    qc = quantization_config(algo, group_size, ignore)
    (out_dir / "config.json").write_text(json.dumps(hf_config(hf_dir, source.args.dtype, qc), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (ckpt_dir / name).is_file():
            shutil.copyfile(ckpt_dir / name, out_dir / name)
    return qc
