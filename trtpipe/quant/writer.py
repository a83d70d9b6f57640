"""Write a quantized TRT-LLM checkpoint: the unquantized checkpoint's ranks with every quantized linear replaced.

Everything that is not a quantized linear (embedding, norms, lm_head, excluded modules) is copied tensor for
tensor from the unquantized checkpoint at the same tp/pp, so sharding, vocab padding and PP layer placement
stay the checkpoint stage's. For each layer: unsharded float weights from a :class:`LayerSource`, statistics
from the calibration artifact -> :func:`layer_params` -> each rank's tensors (quantize after the split).
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import struct
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trtpipe.checkpoint.quant_layouts import ALGOS, LINEARS, quantization_config
from trtpipe.checkpoint.shard import Layout, pp_layers
from trtpipe.checkpoint.writer import TORCH_TO_ST, RankFile
from trtpipe.errors import QuantizationError
from trtpipe.formats.schemes import needs_calibration_data
from trtpipe.models import REGISTRY, get_family
from trtpipe.quant.calibrate import LayerSource, load_layer_stats
from trtpipe.quant.quantize import kv_scales, layer_params, rank_tensors
from trtpipe.runtime.loader import read_config
from trtpipe.runtime.model import ModelArgs
from trtpipe.jsonfile import load_json

ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}


class CheckpointLayers:
    """A TRT-LLM checkpoint of any tp/pp, quantized or not, read one layer at a time: each layer's tensors come
    from its PP group's rank files (``pread``, no mapping stays resident), per tp rank as stored."""

    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir)
        self.config, quant_cfg = read_config(self.dir)
        self.full = ModelArgs.from_config(self.config, quant_cfg)
        self._where = {
            i: (p, local)
            for p in range(self.full.pp)
            for local, i in enumerate(pp_layers(self.full.num_layers, self.full.pp, p))
        }

    def ranks(self, p: int, prefix: str | tuple[str, ...], to_float: bool = False) -> list[dict[str, torch.Tensor]]:
        """Tensors whose names start with ``prefix`` (full names) of every tp rank of PP rank ``p``."""
        tp = self.full.tp
        return [read_tensors(self.dir / f"rank{p * tp + r}.safetensors", prefix, to_float) for r in range(tp)]

    def rank_layer(self, i: int, to_float: bool = False) -> list[dict[str, torch.Tensor]]:
        """Global layer ``i`` as every tp rank stores it, names relative to the layer (what DecoderLayer takes)."""
        p, local = self._where[i]
        prefix = f"transformer.layers.{local}."
        return [{k[len(prefix) :]: t for k, t in r.items()} for r in self.ranks(p, prefix, to_float)]


class TrtllmSource(CheckpointLayers):
    """A :class:`LayerSource` over an unquantized TRT-LLM checkpoint of any tp/pp: each layer is read
    (memory-mapped) from its PP group's rank files and un-split into the unsharded TRT-LLM tensors."""

    def __init__(self, ckpt_dir: Path):
        super().__init__(ckpt_dir)
        if (self.config.get("quantization") or {}).get("quant_algo"):
            raise QuantizationError(f"{self.dir}: the calibration source must be an unquantized checkpoint")
        self.args = self.full.unsharded()

    def embedding(self) -> torch.Tensor:
        name = "transformer.vocab_embedding.weight"
        shards = [r[name] for r in self.ranks(0, name, to_float=True)]
        if len(shards) == 1 or not self.config.get("use_parallel_embedding"):
            return shards[0]
        dim = int(self.config.get("embedding_sharding_dim", 0))
        return torch.cat(shards, dim=dim)[: self.full.vocab_size] if dim == 0 else torch.cat(shards, dim=dim)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        ranks = self.rank_layer(i, to_float=True)
        return {k: unsplit(k, [r[k] for r in ranks], self.full) for k in ranks[0]}


# DeepSeek-V3 (trtpipe.models.deepseek_v3): heads of q_b / q / kv_b, the dense first layers' and the shared experts'
# MLPs split like Llama's (q_a, kv_a and their norms are replicated)
MLA_COLUMN = ("attention.q_b.", "attention.q.", "attention.kv_b.", "ffn.fc.", "ffn.gate.", "mlp.shared_expert.fc.")
MLA_COLUMN += ("mlp.shared_expert.gate.",)
MLA_ROW = ("ffn.proj.weight", "mlp.shared_expert.proj.weight")


def unsplit(name: str, shards: list[torch.Tensor], a: ModelArgs) -> torch.Tensor:
    """Inverse of the checkpoint's TP split of one float tensor of a layer (KV-head replicas dropped)."""
    tp = len(shards)
    if tp == 1:
        return shards[0]
    if a.num_experts and name in ("mlp.fc.weight", "mlp.proj.weight", "mlp.fc.bias", "mlp.proj.bias"):
        return _unsplit_experts(name, shards, a)
    if name == "attention.sinks":  # one per query head: split with the heads
        return torch.cat(shards)
    if name.startswith("attention.qkv."):
        d, nh, nkv_r = a.head_size, a.num_heads // tp, a.kv_heads_per_rank
        parts = [s.split([nh * d, nkv_r * d, nkv_r * d], dim=0) for s in shards]
        step = max(1, tp // a.num_kv_heads)  # ranks holding copies of the same KV head
        q = torch.cat([x[0] for x in parts])
        k = torch.cat([x[1] for x in parts[::step]])
        v = torch.cat([x[2] for x in parts[::step]])
        return torch.cat([q, k, v])
    if name in ("attention.dense.weight", "mlp.proj.weight") + MLA_ROW:
        return torch.cat(shards, dim=1)
    if name.startswith(("mlp.fc.", "mlp.gate.") + MLA_COLUMN):
        return torch.cat(shards, dim=0)
    return shards[0]  # norms and row-parallel biases are replicated


def _unsplit_experts(name: str, shards: list[torch.Tensor], a: ModelArgs) -> torch.Tensor:
    """Stacked experts: rank r holds expert block r % moe_ep, moe_tp slice r // moe_ep ([w3_r; w1_r] on dim 1 for
    fc's weight [E, 2I, H] and bias [E, 2I]); proj's bias [E, H] (gpt-oss) is the same on every moe_tp rank."""
    blocks = []
    for ep in range(a.moe_ep):
        parts = [shards[mtp * a.moe_ep + ep] for mtp in range(a.moe_tp)]
        if name == "mlp.proj.weight":
            blocks.append(torch.cat(parts, dim=-1))
        elif name == "mlp.proj.bias":
            blocks.append(parts[0])
        else:
            halves = [p.chunk(2, dim=1) for p in parts]
            blocks.append(torch.cat([torch.cat([h[0] for h in halves], 1), torch.cat([h[1] for h in halves], 1)], 1))
    return torch.cat(blocks, dim=0)


def excluded_fn(patterns: list[str], layer_idx: int) -> Callable[[str], bool]:
    """linear name (relative) -> whether the recipe's exclude patterns keep it unquantized."""

    def fn(name: str) -> bool:
        full = f"transformer.layers.{layer_idx}.{name}"
        return any(fnmatch.fnmatchcase(full, p) for p in patterns)

    return fn


def quantize_checkpoint(
    base_dir: Path,
    source: LayerSource,
    stats_dir: Optional[Path],
    out_dir: Path,
    *,
    algo: str,
    kv_cache: str,
    group_size: int,
    alpha: float,
    exclude: list[str],
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Write ``config.json`` and ``rank{N}.safetensors`` of the quantized checkpoint into ``out_dir``.

    Memory: one layer (all its tp shards) at a time; each finished layer goes to a part file, and the rank
    files are then assembled with the checkpoint's streaming writer from memory-mapped parts.

    Args:
        base_dir: the unquantized TRT-LLM checkpoint at the target tp/pp.
        source: unsharded float tensors of the same model, one layer at a time.
        stats_dir: calibration artifact (None for data-free algorithms without KV quantization).
        algo / kv_cache / group_size / alpha / exclude: the recipe's quantization settings.

    Returns:
        The written config.json dict.
    """
    cfg = load_json(base_dir / "config.json")
    args = ModelArgs.from_config(cfg)
    a = ALGOS.get(algo)
    kept = get_family(cfg["architecture"]).kept_unquantized if cfg.get("architecture") in REGISTRY else ()
    exclude = list(exclude) + [p for p in kept if p not in exclude]
    layout = Layout(
        args.num_heads,
        args.num_kv_heads,
        args.head_size,
        args.tp,
        num_experts=args.num_experts,
        moe_tp=args.moe_tp,
        moe_ep=args.moe_ep,
    )
    stats_needed = needs_calibration_data(algo, kv_cache)
    if stats_needed and stats_dir is None:
        raise QuantizationError(f"quantization.algo={algo} kv_cache={kv_cache} needs calibration statistics")
    parts = out_dir / ".parts"
    parts.mkdir(parents=True, exist_ok=True)
    try:
        cfg["quantization"] = _write_ranks(
            base_dir,
            source,
            stats_dir,
            out_dir,
            parts,
            args,
            a,
            layout,
            stats_needed,
            algo,
            kv_cache,
            group_size,
            alpha,
            exclude,
            progress,
        )
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    return cfg


def _write_ranks(
    base_dir,
    source,
    stats_dir,
    out_dir,
    parts,
    args,
    a,
    layout,
    stats_needed,
    algo,
    kv_cache,
    group_size,
    alpha,
    exclude,
    progress,
) -> dict:
    """Every layer into part files, then each rank file assembled; returns the config's quantization dict."""
    part_files: dict[int, list[Path]] = {}
    for p in range(args.pp):
        for local, i in enumerate(pp_layers(args.num_layers, args.pp, p)):
            if progress:
                progress(f"({i + 1}/{args.num_layers}) Quantizing")
            stats = load_layer_stats(stats_dir, i) if stats_needed else None
            prefix = f"transformer.layers.{local}."
            params = {}
            if a is not None:
                tensors = source.layer(i)
                weights = {m: tensors[f"{m}.weight"] for m in LINEARS if f"{m}.weight" in tensors}
                params = layer_params(a, weights, stats, group_size, alpha, excluded_fn(exclude, i), args.dtype)
                del tensors, weights
            for r in range(args.tp):
                rank = p * args.tp + r
                layer = read_tensors(base_dir / f"rank{rank}.safetensors", prefix)
                for m in params:
                    for k in [k for k in layer if k.startswith(prefix + m + ".") and not k.endswith(".bias")]:
                        del layer[k]
                if params:
                    layer.update(
                        {
                            prefix + k: t
                            for k, t in rank_tensors(
                                a, params, r, layout, group_size, args.dtype, args.intermediate_size
                            ).items()
                        }
                    )
                if kv_cache != "none":
                    layer.update({prefix + k: t for k, t in kv_scales(kv_cache, stats).items()})
                path = parts / f"rank{rank}.layer{local}.safetensors"
                save_file({k: t.contiguous() for k, t in layer.items()}, str(path))
                part_files.setdefault(rank, []).append(path)
            del params
    for rank in range(args.tp * args.pp):
        _assemble(base_dir / f"rank{rank}.safetensors", part_files.get(rank, []), out_dir / f"rank{rank}.safetensors")
    return quantization_config(algo, kv_cache, group_size, exclude)


def read_tensors(path: Path, prefix: str | tuple[str, ...] = "", to_float: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of ``path`` whose names start with ``prefix``, read with ``pread`` (no mapping stays resident,
    so host memory is what is returned); ``to_float`` converts each one to float32 as soon as it is read."""
    if not path.exists():
        raise QuantizationError(f"{path}: rank file of the checkpoint is missing")
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, e in header.items():
            if not name.startswith(prefix):
                continue
            begin, end = e["data_offsets"]
            buf = bytearray(end - begin)
            f.seek(8 + n + begin)
            f.readinto(buf)
            t = (
                torch.frombuffer(buf, dtype=ST_TO_TORCH[e["dtype"]])
                if buf
                else torch.empty(0, dtype=ST_TO_TORCH[e["dtype"]])
            )
            t = t.view(e["shape"])
            out[name] = t.float() if to_float else t
            del buf
    return out


def _assemble(base: Path, parts: list[Path], out: Path) -> None:
    """rank file = the base file's non-layer tensors + every layer part. Data is read with ``pread`` one base
    tensor or one layer part at a time (no mapping accumulates resident pages), so host memory stays one unit."""
    where: dict[str, Path] = {}
    entries = {}
    for n, path in enumerate([base] + parts):
        with safe_open(str(path), framework="pt") as h:  # headers only
            for k in h.keys():
                if n == 0 and k.startswith("transformer.layers."):
                    continue
                sl = h.get_slice(k)
                where[k], entries[k] = path, (k, ST_TO_TORCH[sl.get_dtype()], tuple(sl.get_shape()))
    f = RankFile(out, [entries[k] for k in sorted(entries)])
    for k in sorted(k for k, path in where.items() if path == base):
        f.write(k, read_tensors(base, k)[k])
    for path in parts:
        for k, t in read_tensors(path).items():
            f.write(k, t)
    f.close()


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Tokenizer and generation files beside the checkpoint, as the checkpoint stage writes them."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in ("config.json",) and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
