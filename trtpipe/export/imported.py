"""A pre-quantized source for the llmapi target (TensorRT-LLM's PyTorch backend): passed through, or re-laid out.

* passed through: the checkpoint is copied file for file (the backend loads it as is); a ModelOpt checkpoint with
  only the flat ``config.json`` form also gets the nested ``hf_quant_config.json`` every release reads.
* re-laid out: every projection is turned into its canonical ModelOpt tensors (:mod:`.canonical`, exact) and
  written as a unified HF checkpoint, one layer at a time (``trtpipe.export.unified.ShardParts``); the source's
  ``quantization_config`` is replaced by ModelOpt's. W4A16 gets the unit ``pre_quant_scale`` o_proj / down_proj
  must carry (the backend's ``load_weights_vanilla`` reads it unconditionally; q/k/v and gate/up do not).
* refused: the format's reason.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from trtpipe.checkpoint.convert import TOKENIZER_FILES, make_plan
from trtpipe.checkpoint.hf import HFReader
from trtpipe.checkpoint.quant_layouts import LINEARS
from trtpipe.errors import CheckpointError
from trtpipe.export.formats import inline_quantization_config
from trtpipe.export.unified import HF_QUANT_CONFIG, ShardParts, hf_config, producer
from trtpipe.models.family import shape_symbols
from trtpipe.quant.imported.canonical import check_projection
from trtpipe.quant.imported.formats import PASSED, RELAID, ImportedFormat
from trtpipe.quant.imported.trtllm import CANONICAL, KV_NAMES, MODEL_DTYPES, matches, module_index
from trtpipe.jsonfile import load_json

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")
# HF projections whose pre_quant_scale the PyTorch backend reads (o_proj, down_proj), by their last name
PQS_PROJECTIONS = ("o_proj", "down_proj")


def write_llmapi(fmt: ImportedFormat, src: Path, out: Path) -> dict:
    """Write the llmapi model directory of ``src`` into ``out``; return its hf_quant_config.json dict."""
    if fmt.llmapi.kind == PASSED:
        return pass_through(fmt, src, out)
    if fmt.llmapi.kind == RELAID:
        return relayout(fmt, src, out)
    raise CheckpointError(f"{src}: {fmt.describe()}: refused for target llmapi: {fmt.llmapi.why}")


def _copy_extras(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def pass_through(fmt: ImportedFormat, src: Path, out: Path) -> dict:
    for pattern in WEIGHT_FILES + ("config.json", HF_QUANT_CONFIG):
        for p in sorted(src.glob(pattern)):
            shutil.copyfile(p, out / p.name)
    _copy_extras(src, out)
    hq_path = out / HF_QUANT_CONFIG
    if fmt.family == "modelopt" and not hq_path.exists():  # the 1.0-era loader reads only the nested file
        hq = {
            "producer": {"name": "modelopt"},
            "quantization": {
                "quant_algo": fmt.quant_algo,
                "kv_cache_quant_algo": fmt.kv_cache,
                **({"group_size": fmt.group_size} if fmt.group_size else {}),
                "exclude_modules": list(fmt.exclude),
            },
        }
        hq_path.write_text(json.dumps(hq, indent=4) + "\n")
    return load_json(hq_path) if hq_path.exists() else {"quantization": {"quant_algo": fmt.quant_algo}}


def relayout(fmt: ImportedFormat, src: Path, out: Path) -> dict:
    plan = make_plan(src)
    info, d = plan.info, shape_symbols(plan.info)
    canonical = CANONICAL[fmt.family]
    model_dtype = MODEL_DTYPES[plan.dtype] if plan.dtype in MODEL_DTYPES else torch.bfloat16
    # HF projection (relative to the layer prefix) -> (out, in), from the family's rules
    projections = {
        h[: -len(".weight")]: (d[s[0]], d[s[1]])
        for r in plan.family.layer_rules
        if r.when(info)
        and r.trt.endswith(".weight")
        and r.trt[: -len(".weight")] in LINEARS
        and r.combine in ("one", "cat")
        for h, s in zip(r.hf, r.shapes)
    }
    kv_names = KV_NAMES.get(fmt.family, ())
    with HFReader(src, check_finite=False) as reader, ShardParts(out, 10 * 10**9) as parts:
        index = module_index(reader.keys())
        pre = info.weight_prefix + plan.family.hf_layer_prefix
        layer_root = pre.split("{}")[0]
        done: set[str] = set()
        excluded: set[str] = set()
        for i in range(info.num_layers):
            layer: dict[str, torch.Tensor] = {}
            for rel, (out_f, in_f) in projections.items():
                module = pre.format(i) + rel
                names = index.get(module, {})
                t = {s: reader.get(n) for s, n in names.items() if s not in ("k_scale", "v_scale")}
                done.update(names.values())
                if matches(module, fmt.exclude):
                    excluded.add(module)
                    layer.update({f"{module}.{s}": v for s, v in t.items()})
                    continue
                c = canonical(fmt, t, module, str(src), out_f, in_f)
                if fmt.quant_algo in ("W4A16_AWQ", "W4A8_AWQ") and rel.rsplit(".", 1)[-1] in PQS_PROJECTIONS:
                    c.setdefault("pre_quant_scale", torch.ones(in_f, dtype=model_dtype))
                check_projection(fmt.quant_algo, module, c, out_f, in_f, fmt.group_size, str(src))
                layer.update({f"{module}.{s}": v for s, v in c.items()})
            if fmt.kv_cache:
                for n, dst in zip(kv_names, ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")):
                    name = pre.format(i) + n
                    if name not in reader:
                        raise CheckpointError(f"{src}: tensor '{name}' is missing (kv cache {fmt.kv_cache})")
                    layer[pre.format(i) + dst] = reader.get(name).float().reshape(())
                    done.add(name)
            for k in reader.keys():  # the layer's norms (and anything else that is not a projection) as they are
                if k.startswith(pre.format(i)) and k not in done:
                    layer[k] = reader.get(k)
                    done.add(k)
            parts.add(f"layer{i}", layer)
            reader.release()
        rest = {k: reader.get(k) for k in reader.keys() if k not in done and not k.startswith(layer_root)}
        parts.add("globals", rest)
    globals_excluded = {k.rsplit(".", 1)[0] for k in rest if k.endswith(".weight") and "norm" not in k}
    exclude = sorted(excluded | globals_excluded)  # names, not patterns (``re:`` has no meaning downstream)
    hq = {
        "producer": producer(),
        "quantization": {
            "quant_algo": fmt.quant_algo,
            "kv_cache_quant_algo": fmt.kv_cache,
            **(
                {"group_size": fmt.group_size, "has_zero_point": False, "pre_quant_scale": True}
                if fmt.quant_algo in ("W4A16_AWQ", "W4A8_AWQ")
                else {}
            ),
            "exclude_modules": exclude,
        },
    }
    (out / "config.json").write_text(
        json.dumps(hf_config(src, plan.dtype, inline_quantization_config(hq)), indent=2) + "\n"
    )
    (out / HF_QUANT_CONFIG).write_text(json.dumps(hq, indent=4) + "\n")
    _copy_extras(src, out)
    return hq
