"""PEFT adapters as the engine path's LoRA tensors: ``model.lora_weights.npy`` and ``model.lora_config.npy``, what
Triton's ``lora_weights`` / ``lora_config`` inputs (and ``lora_prefetch_dir``) take.

The math of TensorRT-LLM's ``examples/hf_lora_convert.py@05316d33`` (``convert_hf_model``), ported:
- tensors are read in ``safe_open(...).keys()`` order (``tensorrt_llm/models/convert_utils.py@03961722``
  ``load_state_dict``) and grouped by layer, then module, in first-seen order (``get_all_lora_weights``);
  ``gate_up_proj``'s ``lora_B`` halves are swapped first (``preprocess_lora_weights``);
- one row per (layer, module): ``lora_A`` flattened, then ``lora_B * scale`` flattened, each cast to the storage
  dtype; upstream assumes the hidden size is the larger dimension: ``lora_A`` is transposed when its second
  dimension is the smaller, ``lora_B`` when its first is, and ``adapter_size`` is the smaller dimension of the
  last tensor seen (``lora_B``'s). So an adapter whose rank is above a module's in or out size is written
  wrong (a transposed tensor, and with out < r a wrong ``adapter_size``): :func:`convert` reproduces that (value for value) and
  :func:`rank_problems` names it;
- ``scale = lora_alpha / r``, or ``lora_alpha / np.sqrt(r)`` with ``use_rslora``;
- rows zero-padded to the longest; ``lora_weights`` ``[1, rows, max_row]`` in the storage dtype, ``lora_config``
  ``[1, rows, 3]`` int32 of (module id, layer, adapter_size), module ids from ``LoraManager.LORA_MODULE_IDS``
  (``tensorrt_llm/lora_manager.py@30e6fb55``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from trtpipe.jsonfile import load_json

# hf_modules_to_trtllm_modules (hf_lora_convert.py@05316d33) -> LORA_MODULE_IDS (lora_manager.py@30e6fb55)
MODULE_IDS = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}
HF_TO_TRTLLM = {
    "q_proj": "attn_q",
    "v_proj": "attn_v",
    "k_proj": "attn_k",
    "qkv_proj": "attn_qkv",
    "query_key_value": "attn_qkv",
    "o_proj": "attn_dense",
    "dense": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
    "gate_up_proj": "mlp_h_to_4h",
    "c_fc": "mlp_h_to_4h",
    "c_proj": "mlp_4h_to_h",
}
_KEY = re.compile(r".*\.layers\.([0-9]+)\.(self_attn|mlp)\.([a-z_]+)\.lora_(A|B)\.weight.*")
DTYPES = {"float32": torch.float32, "float16": torch.float16}  # bfloat16 (numpy has none): not ported


def _tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), framework="pt", device="cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _grouped(tensors: dict[str, torch.Tensor]) -> dict:
    out: dict = defaultdict(lambda: defaultdict(dict))
    for key, w in tensors.items():
        if "gate_up_proj.lora_B.weight" in key:  # preprocess_lora_weights: swap the halves
            half = w.shape[0] // 2
            w = torch.cat((w[half:], w[:half]), dim=0)
        m = _KEY.match(key)
        if m:
            out[int(m.group(1))][m.group(3)]["in" if m.group(4) == "A" else "out"] = w
    return out


def convert(adapter_dir: Path, dtype: str = "float16") -> tuple[np.ndarray, np.ndarray]:
    """(``lora_weights`` [1, rows, max_row] of ``dtype``, ``lora_config`` [1, rows, 3] int32) of a PEFT adapter."""
    cfg = load_json(Path(adapter_dir) / "adapter_config.json")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    scale = alpha / np.sqrt(rank) if cfg.get("use_rslora", False) else alpha / rank
    if dtype not in DTYPES:
        raise ValueError(f"storage dtype {dtype!r}: {' or '.join(DTYPES)} (bfloat16 is not ported)")
    torch_dtype = DTYPES[dtype]
    rows, config = [], []
    for layer, modules in _grouped(_tensors(adapter_dir)).items():
        for hf_module, w in modules.items():
            parts, adapter_size = [], 0
            for t, inout in ((w["in"], "in"), (w["out"], "out")):
                dim0, dim1 = t.shape
                adapter_size = min(dim0, dim1)
                if dim1 < dim0 and inout == "in":
                    adapter_size, t = dim1, t.transpose(1, 0)
                elif dim0 < dim1 and inout == "out":
                    adapter_size, t = dim0, t.transpose(1, 0)
                if inout == "out":
                    t = t * scale
                parts.append(t.contiguous().flatten().to(dtype=torch_dtype))
            rows.append(torch.concatenate(parts).flatten())
            config.append([MODULE_IDS[HF_TO_TRTLLM[hf_module]], layer, adapter_size])
    width = max(r.shape[0] for r in rows)
    padded = [torch.nn.functional.pad(r, (0, width - r.shape[0])).unsqueeze(0) for r in rows]
    weights = torch.concatenate(padded, dim=0).unsqueeze(0).to(dtype=torch_dtype).numpy()
    return weights, torch.tensor(config, dtype=torch.int32).unsqueeze(0).numpy()


def write(adapter_dir: Path, out_dir: Path, dtype: str = "float16") -> Path:
    """``out_dir/model.lora_weights.npy`` and ``model.lora_config.npy`` (upstream's ``save_val(..., write_npy=True)``)."""
    weights, config = convert(adapter_dir, dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "model.lora_weights.npy", weights)
    np.save(out_dir / "model.lora_config.npy", config)
    return out_dir


def rank_problems(adapter_dir: Path) -> list[str]:
    """Modules whose rank is above their in or out size: upstream's converter writes them wrong (it takes the
    smaller dimension of each tensor for the rank, so it transposes ``lora_A`` when in < r and ``lora_B`` when
    out < r, and writes ``adapter_size`` min(out, r))."""
    cfg = load_json(Path(adapter_dir) / "adapter_config.json")
    r = int(cfg["r"])
    out = []
    for layer, modules in _grouped(_tensors(adapter_dir)).items():
        for hf_module, w in modules.items():
            fan_in, fan_out = w["in"].shape[1], w["out"].shape[0]
            if r > min(fan_in, fan_out):  # r equal to a size: the square tensor is not transposed, r is right
                out.append(f"layer {layer} {hf_module}: r={r} is above one of its sizes (in {fan_in}, out {fan_out})")
    return out
