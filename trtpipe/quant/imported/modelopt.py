"""ModelOpt's unified HF checkpoint (``export_hf_checkpoint``, also what trtpipe's llmapi target writes).

Config: ``hf_quant_config.json`` ``{"producer": {"name": "modelopt"}, "quantization": {quant_algo,
kv_cache_quant_algo, group_size, exclude_modules}}`` (what every TensorRT-LLM release reads; it wins), or the
flat ``config.json: quantization_config`` with ``quant_method: modelopt``, ``quant_algo``, ``ignore``,
``kv_cache_scheme``. Tensors are already the canonical form (:mod:`.canonical`), so the re-layout is the identity.
What each target does per ``quant_algo`` is the table :data:`ALGOS` (the PyTorch backend's loader rejects
``W8A8_SQ_PER_CHANNEL`` and INT8 KV caches; NVFP4 is converted for dense linears only, :mod:`.trtllm`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trtpipe.errors import CheckpointError
from trtpipe.formats.schemes import BY_QUANT_ALGO, BY_RECIPE
from trtpipe.quant.imported.formats import CONVERTED, PASSED, REFUSED, Action, ImportedFormat

LLMAPI_OK = Action(PASSED)
ENGINE_OK = Action(CONVERTED)
GRANULARITY = {"tensor": "per-tensor", "channel": "per-channel", "group": "group"}
# quant_algo -> (engine, llmapi) where a target does not take it (every other one is converted / passed; FP4 below
# Blackwell is validate's tensor-core rule)
REFUSED_BY: dict[str, tuple[Action, Action]] = {
    "W8A8_SQ_PER_CHANNEL": (
        Action(
            REFUSED,
            "trtpipe does not convert ModelOpt INT8 SmoothQuant exports yet (no producer checkpoint to check "
            "the conversion against); quantize the original with quantization.algo: int8_sq",
        ),
        Action(
            REFUSED,
            "the PyTorch backend has no W8A8_SQ_PER_CHANNEL linear method ('unsupported quant mode'); "
            "use target: engine",
        ),
    ),
}
# quant_algo -> (bits, granularity, engine, llmapi): ModelOpt writes the quant_algos of the recipe's schemes
# (trtpipe.formats.schemes), with the same names
ALGOS: dict[Optional[str], tuple[Optional[int], str, Action, Action]] = {
    None: (None, "per-tensor", ENGINE_OK, LLMAPI_OK),  # KV-cache only
    **{
        s.quant_algo: (s.bits, GRANULARITY[s.scale], *REFUSED_BY.get(s.quant_algo, (ENGINE_OK, LLMAPI_OK)))
        for s in BY_RECIPE.values()
    },
}
KV_ALGOS = (None, "FP8")


def is_modelopt(hf_quant: Optional[dict], qc: Optional[dict]) -> bool:
    producer = ((hf_quant or {}).get("producer") or {}).get("name")
    return (
        producer == "modelopt"
        or (hf_quant is not None and "quantization" in hf_quant)
        or str((qc or {}).get("quant_method", "")).startswith("modelopt")
    )


def parse(model_dir: Path, hf_quant: Optional[dict], qc: Optional[dict]) -> ImportedFormat:
    """The format of a ModelOpt unified checkpoint (nested hf_quant_config.json first, as TensorRT-LLM reads it)."""
    if hf_quant is not None:
        where = f"{model_dir / 'hf_quant_config.json'}"
        q = hf_quant.get("quantization")
        if not isinstance(q, dict):
            raise CheckpointError(f"{where}: 'quantization' must be an object")
        algo, kv, exclude = q.get("quant_algo"), q.get("kv_cache_quant_algo"), q.get("exclude_modules") or []
        group = q.get("group_size")
        key = "quantization.quant_algo"
    else:
        where = f"{model_dir / 'config.json'}"
        algo, exclude, group = qc.get("quant_algo"), qc.get("ignore") or [], qc.get("group_size")
        kv = "FP8" if qc.get("kv_cache_scheme") else None
        key = "quantization_config.quant_algo"
    if algo not in ALGOS:
        known = ", ".join(a for a in ALGOS if a)
        raise CheckpointError(f"{where}: {key} '{algo}' is not a ModelOpt format trtpipe imports (known: {known})")
    if kv not in KV_ALGOS:
        raise CheckpointError(
            f"{where}: kv_cache_quant_algo '{kv}' is not imported (FP8 or none; TensorRT-LLM's "
            "PyTorch backend refuses other pre-quantized KV caches)"
        )
    bits, gran, engine, llmapi = ALGOS[algo]
    if gran == "group":
        group = BY_QUANT_ALGO[algo].block or group
        if not isinstance(group, int) or group < 1:
            raise CheckpointError(
                f"{where}: group_size is {group!r}; {algo} needs a positive integer group size "
                "(absent, TensorRT-LLM silently assumes 128)"
            )
    else:
        group = None
    return ImportedFormat(
        "modelopt", algo or "kv-only", algo, bits, group, gran, tuple(exclude), kv, engine, llmapi, where
    )
