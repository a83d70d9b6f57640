"""EAGLE-1/2 heads into a TensorRT-LLM checkpoint, as upstream's converter writes them.

``examples/eagle/convert_checkpoint.py@04a2cacb`` (``--eagle_model_dir DIR --num_eagle_layers N --max_draft_len L``)
converts the base model and adds, through ``load_eagle_hf`` (``tensorrt_llm/models/eagle/weight.py@535c9cc6``), for
every EagleNet ``i < num_eagle_layers`` (each a full copy: "FIXME tensors are duplicated on disk"):

- ``eagle_nets.{i}.drafter.fc.weight`` / ``.bias`` from the head's ``fc``,
- ``eagle_nets.{i}.lm_head.weight``, the *base model's* lm_head ("Use main model to duplicate lm_head"),
- ``eagle_nets.{i}.drafter.{name}`` for the head's Llama tensors as ``convert_hf_llama`` names them
  (``layers.{l}.attention.qkv`` / ``attention.dense`` / ``mlp.fc`` / ``mlp.gate`` / ``mlp.proj`` /
  ``post_layernorm``, ``vocab_embedding.weight``), without ``input_layernorm``, ``lm_head`` or ``ln_f``,

each split over tp as ``convert_hf_llama`` / ``split`` do (qkv, fc, lm_head and mlp.fc/gate along dim 0 per q/k/v,
dense and mlp.proj along dim 1; norms and the embedding whole). config.json becomes ``architecture:
EagleForCausalLM`` with ``num_eagle_layers``, ``max_draft_len``, ``max_non_leaves_per_layer`` and ``eagle_net_config``
(the head's LlamaForCausalLM config), as ``EagleConfig.to_dict`` serializes it
(``tensorrt_llm/models/eagle/config.py@0382a8ac``). Only layer 0 lacks ``input_layernorm`` here: a head with more
layers keeps its later ones (upstream's loop drops every ``input_layernorm``; the published heads have one layer).
Pipeline parallelism is not converted (the EagleNets live on the last pp rank): refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trtpipe.checkpoint.head_files import read_head_dir
from trtpipe.checkpoint.shard import split_even
from trtpipe.checkpoint.writer import atomic_dir, write_json
from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json
from trtpipe.recipe.eagle import HEAD_FILES

ARCHITECTURE = "EagleForCausalLM"  # the TensorRT-LLM checkpoint (tensorrt_llm/models/eagle/config.py@0382a8ac)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ROW = ("attention.dense.weight", "mlp.proj.weight")  # split along dim 1
COLUMN = ("mlp.fc.weight", "mlp.gate.weight")  # split along dim 0
WHOLE = ("post_layernorm.weight", "input_layernorm.weight")
# eagle_net_config (TensorRT-LLM names) <-> the head's LlamaConfig names
NET_KEYS = {
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_key_value_heads": "num_key_value_heads",
    "max_position_embeddings": "max_position_embeddings",
    "hidden_act": "hidden_act",
    "rotary_base": "rope_theta",
    "rotary_scaling": "rope_scaling",
    "norm_epsilon": "rms_norm_eps",
    "head_dim": "head_dim",
}


LAYER_NAMES = {  # HF (cnets1.py) -> TensorRT-LLM names (convert_hf_llama, tensorrt_llm/models/eagle/weight.py@535c9cc6)
    "self_attn.o_proj.weight": "attention.dense.weight",
    "mlp.gate_proj.weight": "mlp.fc.weight",
    "mlp.up_proj.weight": "mlp.gate.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
}


def read_head(head_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A published EAGLE-1/2 head's tensors (``model.`` prefix stripped) and config.json; CheckpointError otherwise."""
    return read_head_dir(head_dir, "EAGLE head", HEAD_FILES, ("model.",))


def trt_layer_tensors(t: dict, layer: int, where: str) -> dict[str, torch.Tensor]:
    """Layer ``layer`` of a published head in TensorRT-LLM's names (``attention.qkv`` = q, k, v concatenated);
    layer 0 has no ``input_layernorm``."""
    pre = f"layers.{layer}."
    need = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "post_attention_layernorm.weight",
    ]
    need += ["input_layernorm.weight"] if layer > 0 else []
    for n in need:
        if pre + n not in t:
            raise CheckpointError(f"{where}: EAGLE head tensor '{pre}{n}' is missing")
    out = {"attention.qkv.weight": torch.cat([t[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"])}
    for hf, trt in LAYER_NAMES.items():
        if pre + hf in t:
            out[trt] = t[pre + hf]
    return out


def head_dims(cfg: dict, vocab_size: int, where: str):
    """The head's shapes from its (Llama) config.json (:class:`~trtpipe.models.dims.ModelDims`); its logits are over
    the target's vocabulary."""
    from trtpipe.models.dims import parse_hf_config

    view = {**cfg, "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size}
    view["num_hidden_layers"] = int(cfg.get("num_hidden_layers") or 1)
    return parse_hf_config(view, where)


def _qkv_split(qkv: torch.Tensor, q_rows: int, kv_rows: int, rank: int, tp: int) -> torch.Tensor:
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
    return torch.cat([split_even(x, 0, rank, tp, "attention.qkv.weight") for x in (q, k, v)])


def net_config(cfg: dict, args, dtype: str, tp: int) -> dict:
    """``eagle_net_config`` as upstream's converter writes it (``convert_checkpoint.py@04a2cacb``, plus
    ``head_dim`` / ``head_size`` of ``EagleConfig.from_hugging_face``, config.py@0382a8ac)."""
    return {
        "architecture": "LlamaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_key_value_heads": args.num_kv_heads,
        "vocab_size": args.vocab_size,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": args.max_position_embeddings,
        "hidden_act": args.hidden_act,
        "rotary_base": args.rope_theta,
        "rotary_scaling": args.rope_scaling,
        "norm_epsilon": args.rms_norm_eps,
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "head_dim": args.head_dim,
        "head_size": args.head_dim,
    }


def eagle_net_tensors(
    t: dict, args, lm_head: torch.Tensor, num_eagle_layers: int, dtype: torch.dtype, tp: int, rank: int, where: str
) -> dict[str, torch.Tensor]:
    """One tp rank's ``eagle_nets.*`` tensors from a published head's tensors ``t`` (trtpipe.serving.eagle1 names)."""
    if args.num_kv_heads % tp or args.num_heads % tp:
        raise CheckpointError(f"{where}: the head's {args.num_kv_heads} KV heads do not split over tp {tp}")
    q_rows, kv_rows = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    net = {
        "fc.weight": split_even(t["fc.weight"].to(dtype), 0, rank, tp, "fc.weight"),
        "fc.bias": split_even(t["fc.bias"].to(dtype), 0, rank, tp, "fc.bias"),
        "vocab_embedding.weight": t["embed_tokens.weight"].to(dtype),
    }
    for i in range(args.num_layers):
        for name, w in trt_layer_tensors(t, i, where).items():
            w = w.to(dtype)
            if name == "attention.qkv.weight":
                w = _qkv_split(w, q_rows, kv_rows, rank, tp)
            elif name in ROW:
                w = split_even(w, 1, rank, tp, name)
            elif name in COLUMN:
                w = split_even(w, 0, rank, tp, name)
            net[f"layers.{i}.{name}"] = w
    out = {}
    for e in range(num_eagle_layers):
        out.update({f"eagle_nets.{e}.drafter.{k}": v.clone().contiguous() for k, v in net.items()})
        out[f"eagle_nets.{e}.lm_head.weight"] = lm_head.clone().contiguous()
    return out


def write_eagle_checkpoint(
    checkpoint_dir: str | Path,
    head_dir: str | Path,
    out_dir: str | Path,
    num_eagle_layers: int,
    max_draft_len: int,
    max_non_leaves_per_layer: int,
) -> Path:
    """``checkpoint_dir`` with the EAGLE head of ``head_dir`` added, written atomically to ``out_dir``."""
    src, out = Path(checkpoint_dir), Path(out_dir)
    cfg = load_json(src / "config.json", CheckpointError)
    t, hcfg = read_head(head_dir)
    where = str(head_dir)
    for n in ("fc.weight", "fc.bias"):
        if n not in t:
            raise CheckpointError(f"{where}: EAGLE head tensor '{n}' is missing")
    m = cfg.get("mapping", {})
    tp, pp = int(m.get("tp_size", 1)), int(m.get("pp_size", 1))
    if pp != 1:
        raise CheckpointError(f"{src}: EAGLE heads are converted at pp 1 only (the checkpoint has pp {pp})")
    V = int(cfg["vocab_size"])
    args = head_dims(hcfg, V, str(Path(head_dir) / "config.json"))
    if args.hidden_size != int(cfg["hidden_size"]):
        raise CheckpointError(f"{where}: EAGLE head hidden_size {args.hidden_size} differs from the target's")
    if "embed_tokens.weight" not in t:  # cnets1.py loads the base model's embedding when the head has none
        t["embed_tokens.weight"] = load_file(str(src / "rank0.safetensors"))["transformer.vocab_embedding.weight"]
    dtype_name = cfg.get("dtype", "float16")
    dtype = DTYPES.get(dtype_name, torch.float16)
    with atomic_dir(out, overwrite=True) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.startswith("rank"):
                shutil.copy2(f, tmp / f.name)
        for r in range(tp):
            tensors = load_file(str(src / f"rank{r}.safetensors"))
            if "lm_head.weight" not in tensors:
                raise CheckpointError(f"{src}/rank{r}.safetensors: no lm_head.weight for the EagleNets to copy")
            tensors.update(eagle_net_tensors(t, args, tensors["lm_head.weight"], num_eagle_layers, dtype, tp, r, where))
            save_file(tensors, str(tmp / f"rank{r}.safetensors"), metadata={"format": "pt"})
        cfg = {
            **cfg,
            "architecture": ARCHITECTURE,
            "max_draft_len": max_draft_len,
            "num_eagle_layers": num_eagle_layers,
            "max_non_leaves_per_layer": max_non_leaves_per_layer,
            "eagle_net_config": net_config(hcfg, args, dtype_name, tp),
        }
        write_json(tmp / "config.json", cfg)
    return out


def checkpoint_head(checkpoint_dir: str | Path) -> tuple[list[dict], tuple, torch.Tensor, dict]:
    """EagleNet 0 of an ``EagleForCausalLM`` checkpoint, tp shards gathered: (per layer its TensorRT-LLM-named
    tensors, (fc weight, fc bias), the embedding, the head's LlamaConfig-named config)."""
    d = Path(checkpoint_dir)
    cfg = load_json(d / "config.json", CheckpointError)
    if cfg.get("architecture") != ARCHITECTURE or "eagle_net_config" not in cfg:
        raise CheckpointError(f"{d}: architecture {cfg.get('architecture')} is not {ARCHITECTURE}")
    net = cfg["eagle_net_config"]
    hf = {hf: net[k] for k, hf in NET_KEYS.items() if k in net}
    tp = int(cfg.get("mapping", {}).get("tp_size", 1))
    shards = [load_file(str(d / f"rank{r}.safetensors")) for r in range(tp)]
    pre = "eagle_nets.0.drafter."

    def get(name: str, dim) -> torch.Tensor:
        if pre + name not in shards[0]:
            raise CheckpointError(f"{d}: tensor '{pre}{name}' is missing")
        return shards[0][pre + name] if dim is None else torch.cat([s[pre + name] for s in shards], dim)

    q_rows = int(net["num_attention_heads"]) * int(net["head_dim"]) // tp
    kv_rows = int(net["num_key_value_heads"]) * int(net["head_dim"]) // tp
    layers = []
    for i in range(int(net["num_hidden_layers"])):
        parts = [s[f"{pre}layers.{i}.attention.qkv.weight"].split([q_rows, kv_rows, kv_rows]) for s in shards]
        layer = {"attention.qkv.weight": torch.cat([torch.cat([p[j] for p in parts]) for j in range(3)])}
        for name in ROW + COLUMN + WHOLE:
            if i == 0 and name == "input_layernorm.weight":
                continue
            layer[name] = get(f"layers.{i}.{name}", 1 if name in ROW else 0 if name in COLUMN else None)
        layers.append(layer)
    fc = (get("fc.weight", 0), get("fc.bias", 0))
    return layers, fc, get("vocab_embedding.weight", None), hf
