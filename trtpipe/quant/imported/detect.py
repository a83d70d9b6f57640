"""Recognise a pre-quantized checkpoint from its config files: one table, ``quant_method`` -> parser.

Precedence is TensorRT-LLM's (``_torch/model_config.py::ModelConfig.from_pretrained``): ``hf_quant_config.json``
first, then ``config.json: quantization_config``. A ``quant_method`` not in :data:`PARSERS` is refused naming the
key; no config at all means an unquantized checkpoint (None).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

from trtpipe.errors import CheckpointError
from trtpipe.quant.imported import awq, compressed, gptq, modelopt, others
from trtpipe.quant.imported.formats import ImportedFormat
from trtpipe.jsonfile import load_json

HF_QUANT_CONFIG = "hf_quant_config.json"

# config.json quantization_config.quant_method -> parser(model_dir, quantization_config, where)
PARSERS: dict[str, Callable[[Path, dict, str], ImportedFormat]] = {
    "compressed-tensors": lambda d, qc, where: compressed.parse(d, qc),
    "awq": awq.parse,
    "gptq": gptq.parse,
    "fbgemm_fp8": others.parse_fbgemm,
    "fp8": others.parse_fp8,
    "mxfp4": others.parse_mxfp4,
}


def _json(path: Path) -> Optional[dict]:
    if not path.is_file():
        return None
    try:
        data = load_json(path, CheckpointError)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: a JSON {type(data).__name__}, an object is needed")
    return data


def detect_config(model_dir: Path, cfg: dict, hf_quant: Optional[dict] = None) -> Optional[ImportedFormat]:
    """The format described by ``cfg`` (config.json) and ``hf_quant`` (hf_quant_config.json, if any)."""
    qc = cfg.get("quantization_config")
    if isinstance(cfg.get("text_config"), dict) and qc is None:
        qc = cfg["text_config"].get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{model_dir / 'config.json'}: quantization_config must be an object")
    if hf_quant is None and not qc:
        return None
    if modelopt.is_modelopt(hf_quant, qc):
        return modelopt.parse(model_dir, hf_quant, qc)
    method = qc.get("quant_method")
    if method not in PARSERS:
        raise CheckpointError(
            f"{model_dir / 'config.json'}: quantization_config.quant_method {method!r} is not a "
            f"format trtpipe knows (known: modelopt, {', '.join(PARSERS)})"
        )
    return PARSERS[method](model_dir, qc, f"{model_dir / 'config.json'}")


def detect(model_dir: str | Path) -> Optional[ImportedFormat]:
    """The pre-quantized format of a local HF model directory, or None when it is not quantized."""
    d = Path(model_dir)
    cfg = _json(d / "config.json")
    if cfg is None:
        raise CheckpointError(f"{d}: no config.json")
    return detect_config(d, cfg, _json(d / HF_QUANT_CONFIG))
