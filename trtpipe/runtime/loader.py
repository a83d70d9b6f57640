"""Load a TensorRT-LLM checkpoint directory (any tp/pp layout) into a :class:`ReferenceModel`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from trtpipe.checkpoint.shard import pp_layers
from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import read_json
from trtpipe.runtime.linear import Float32Linear, LinearSpec, build_linear, module_quant_algo
from trtpipe.runtime.model import DecoderLayer, ModelArgs, ReferenceModel


def read_config(ckpt_dir: Path) -> tuple[dict, Optional[dict]]:
    """config.json (and quant_cfg.json for MIXED_PRECISION) of a TRT-LLM checkpoint."""
    cfg = read_json(ckpt_dir / "config.json", f"{ckpt_dir} a TensorRT-LLM checkpoint", CheckpointError)
    qpath = ckpt_dir / "quant_cfg.json"
    return cfg, (read_json(qpath, "a quant_cfg.json", CheckpointError) if qpath.exists() else None)


def read_rank(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"{path}: rank file not found")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors: {exc}") from None


def with_prefix(tensors: dict, prefix: str) -> dict:
    """The tensors whose names start with ``prefix``, keyed by the rest of the name (one layer's or module's)."""
    return {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}


def embedding_table(cfg: dict, args: ModelArgs, first_ranks: list[dict]) -> torch.Tensor:
    """The whole vocabulary embedding from the first PP stage's rank files (all-gathered when it is sharded)."""
    name = "transformer.vocab_embedding.weight"
    if name not in first_ranks[0]:
        raise CheckpointError(f"checkpoint: tensor '{name}' is missing from rank0.safetensors")
    if not cfg.get("use_parallel_embedding") or args.tp == 1:
        return first_ranks[0][name]
    dim = int(cfg.get("embedding_sharding_dim", 0))
    full = torch.cat([r[name] for r in first_ranks], dim=dim)  # the all-gather of a sharded table
    return full[: args.vocab_size] if dim == 0 else full


def lm_head_linears(args: ModelArgs, last_ranks: list[dict], embedding: torch.Tensor) -> list:
    """One lm_head linear per tp rank of the last PP stage (the embedding table itself when they share it)."""
    if "lm_head.weight" not in last_ranks[0]:  # shared embedding table
        return [Float32Linear(embedding)]
    algo = module_quant_algo("lm_head", args.quantization, args.quant_cfg)
    if args.attention_dp:  # every rank holds the whole lm_head: one copy
        last_ranks = last_ranks[:1]
    return [
        build_linear(
            with_prefix(r, "lm_head."),
            LinearSpec("lm_head", algo, args.quantization or {}, args.dtype, "column", i, args.tp),
        )
        for i, r in enumerate(last_ranks)
    ]


def load_checkpoint(ckpt_dir: str | Path, device: str = "cpu") -> ReferenceModel:
    """Read config.json and every rank{N}.safetensors; build the model that runs all ranks in one process.

    Args:
        ckpt_dir: a TRT-LLM checkpoint directory (quantized or not, any tp x pp).
        device: where tensors are loaded (computation is float32).
    Raises:
        CheckpointError: naming the missing file/tensor or the bad config key.
    """
    ckpt_dir = Path(ckpt_dir)
    cfg, quant_cfg = read_config(ckpt_dir)
    args = ModelArgs.from_config(cfg, quant_cfg)
    ranks = [read_rank(ckpt_dir / f"rank{r}.safetensors", device) for r in range(args.tp * args.pp)]
    by_pp = [ranks[p * args.tp : (p + 1) * args.tp] for p in range(args.pp)]
    rope = args.ropes()
    layers = []
    for p, group in enumerate(by_pp):
        for local, global_idx in enumerate(pp_layers(args.num_layers, args.pp, p)):
            shards = [with_prefix(r, f"transformer.layers.{local}.") for r in group]
            if not shards[0]:
                raise CheckpointError(
                    f"rank{p * args.tp}.safetensors: layer {local} (global {global_idx}) has no tensors"
                )
            layers.append(DecoderLayer(args, shards, global_idx, rope))
    embedding = embedding_table(cfg, args, by_pp[0])
    if "transformer.ln_f.weight" not in by_pp[-1][0]:
        raise CheckpointError("checkpoint: tensor 'transformer.ln_f.weight' is missing from the last PP rank")
    ln_f = by_pp[-1][0]["transformer.ln_f.weight"]
    return ReferenceModel(cfg, args, embedding, layers, ln_f, lm_head_linears(args, by_pp[-1], embedding.float()))
