"""``trtpipe inspect``: what an HF model directory or a TRT-LLM checkpoint holds, from headers only."""

from __future__ import annotations

from pathlib import Path

from trtpipe.checkpoint.hf import HFReader, SafetensorsFile
from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import read_json
from trtpipe.models import num_params
from trtpipe.models.dims import read_hf_config
from trtpipe.models.trtllm_config import shape_fields


def _file_summary(path: Path) -> dict:
    f = SafetensorsFile(path)
    try:
        dtypes: dict[str, int] = {}
        for dtype, _, _, numel in f.entries.values():
            key = str(dtype).replace("torch.", "")
            dtypes[key] = dtypes.get(key, 0) + numel
        return {"file": path.name, "tensors": len(f.entries), "bytes": path.stat().st_size, "elements_by_dtype": dtypes}
    finally:
        f.close()


def _quant_summary(q: dict) -> dict:
    if not q.get("quant_algo") and not q.get("kv_cache_quant_algo"):
        return {"quant_algo": None}
    return {k: v for k, v in q.items() if v not in (None, False)}


def inspect_trtllm(ckpt: Path) -> dict:
    cfg = read_json(ckpt / "config.json", f"{ckpt} a TensorRT-LLM checkpoint", CheckpointError)
    m = cfg.get("mapping", {})
    world = int(m.get("world_size", int(m.get("tp_size", 1)) * int(m.get("pp_size", 1))))
    ranks = []
    for r in range(world):
        path = ckpt / f"rank{r}.safetensors"
        if not path.exists():
            raise CheckpointError(f"{path}: missing (mapping.world_size is {world})")
        ranks.append(_file_summary(path))
    keys = (
        "architecture",
        "dtype",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_size",
        "intermediate_size",
        "rotary_base",
        "rotary_scaling",
    )
    return {
        "kind": "tensorrt-llm checkpoint",
        "path": str(ckpt),
        **{k: cfg.get(k) for k in keys},
        "moe": cfg.get("moe") if (cfg.get("moe") or {}).get("num_experts") else None,
        "mapping": {k: m.get(k) for k in ("world_size", "tp_size", "pp_size", "moe_tp_size", "moe_ep_size")},
        "quantization": _quant_summary(cfg.get("quantization") or {}),
        "ranks": ranks,
        "total_bytes": sum(r["bytes"] for r in ranks),
    }


def inspect_hf(model_dir: Path) -> dict:
    from trtpipe.quant.imported.detect import detect

    info = read_hf_config(model_dir)
    fmt = detect(model_dir)  # a config contradicting itself fails here, naming the key
    with HFReader(model_dir, allow_pickle=False, check_finite=False) as reader:
        files = sorted({p for p in model_dir.glob("*.safetensors")})
        return {
            "kind": "hugging face model",
            "path": str(model_dir),
            "architecture": info.architecture,
            "dtype": info.torch_dtype,
            **shape_fields(info),
            "rope_theta": info.rope_theta,
            "rope_scaling": info.rope_scaling,
            "num_experts": info.num_experts or None,
            "sliding_window": info.sliding_window,
            "tie_word_embeddings": info.tie_word_embeddings,
            "quantization": info.raw.get("quantization_config"),
            "pre_quantized": fmt.describe() if fmt else None,
            "targets": {
                t: fmt.action(t).kind + (f": {fmt.action(t).why}" if not fmt.action(t).ok else "")
                for t in ("engine", "llmapi")
            }
            if fmt
            else None,
            "parameters": num_params(info),
            "tensors": len(reader.keys()),
            "files": [_file_summary(p) for p in files],
            "total_bytes": sum(p.stat().st_size for p in files),
        }


def inspect_path(path: str | Path) -> dict:
    """Summarize a TRT-LLM checkpoint (config.json with ``architecture`` + rank files) or an HF model dir."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: no config.json (not an HF model or TRT-LLM checkpoint)")
    cfg = read_json(cfg_path, "an HF model or TRT-LLM checkpoint", CheckpointError)
    if "architecture" in cfg and "mapping" in cfg:
        return inspect_trtllm(path)
    return inspect_hf(path)


def format_summary(s: dict) -> str:
    """Human-readable lines for the CLI."""
    lines = [f"{s['path']}: {s['kind']}"]
    skip = {"kind", "path", "ranks", "files"}
    for k, v in s.items():
        if k not in skip and v not in (None, {}, []):
            lines.append(f"  {k}: {v}")
    for r in s.get("ranks", []) + s.get("files", []):
        lines.append(f"  {r['file']}: {r['tensors']} tensors, {r['bytes']:,} bytes, {r['elements_by_dtype']}")
    return "\n".join(lines)
