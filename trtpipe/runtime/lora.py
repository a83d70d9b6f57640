"""LoRA adapters on the reference runtime: PEFT adapters read, checked against the base model, and applied to a
packed step as low-rank deltas grouped by adapter.

Policy:
- An adapter is a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``). The subset served:
  ``peft_type: LORA``, ``bias: none``, no DoRA, no ``modules_to_save``, no ``fan_in_fan_out``, no per-module
  ``rank_pattern`` / ``alpha_pattern``, no ``layers_to_transform``; anything else is refused in one line naming the
  adapter and the key (never silently computed differently from peft).
- The delta of a targeted linear is ``scaling * B (A x)`` with ``scaling = lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` with ``use_rslora`` (peft 0.21.2 ``peft/tuners/lora/layer.py`` ``LoraLayer.update_layer``).
- HF module names map onto TensorRT-LLM's linears through the family's conversion rules
  (:class:`~trtpipe.checkpoint.hf_names.HFNames`): q/k/v_proj land in rows of the fused ``attention.qkv``,
  gate_proj is ``mlp.fc``, up_proj ``mlp.gate``, down_proj ``mlp.proj``, o_proj ``attention.dense``. A fused linear
  gets one pair: A stacked over its targeted parts, B block-diagonal at each part's rows, so each linear costs
  two small GEMMs per adapter.
- One step runs the base GEMM once over every packed token; each adapter's tokens are gathered, get their delta, and
  are added back (:class:`LoraLinear`): "the base GEMM once, the deltas grouped by adapter".
- At tp > 1 each rank holds its shard of every pair, split as TensorRT-LLM splits LoRA weights
  (``tensorrt_llm/lora_manager.py@007e181b``, ``LoraManager.load_from_hf``): the row-parallel modules
  (``attn_dense``, ``mlp_4h_to_h``) split ``lora_A`` along its input (A_r x_r per rank, summed by the layer's
  all-reduce with the base partial), every other module splits ``lora_B`` along its output, as the base weight's rows
  are split (:func:`shard_pair`). Upstream splits q, k and v each evenly; the fused qkv here takes the same rows the
  base's own ``qkv`` split takes (:func:`~trtpipe.checkpoint.shard.split_linear_tensor`, KV heads replicated when
  fewer than tp, where upstream's even split would not divide). Both the one-process model (every rank's shards)
  and the one-process-per-rank :class:`~trtpipe.runtime.distributed.RankModel` are served.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from trtpipe.errors import CheckpointError, TrtpipeError
from trtpipe.jsonfile import load_json

# TRT-LLM linear -> (DecoderLayer attribute holding the shard list, attribute of the shard)
LINEARS = {
    "attention.qkv": ("attention", "qkv"),
    "attention.dense": ("attention", "dense"),
    "mlp.fc": ("mlp", "fc"),
    "mlp.gate": ("mlp", "gate"),
    "mlp.proj": ("mlp", "proj"),
}
# Keys of adapter_config.json this runtime does not compute, with the value it requires (peft's defaults).
UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None, []),
    "layers_pattern": (None, []),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}),
}
WEIGHT_FILES = ("adapter_model.safetensors",)


class AdapterError(TrtpipeError):
    """An adapter that cannot be served on this base model (one line: the adapter, the file or key, why)."""


@dataclass(frozen=True)
class LoraPair:
    """The delta of one TRT-LLM linear: ``scaling * b @ (a @ x)``; ``a`` [R, in], ``b`` [out, R] as the adapter
    stores them (the scaling applied last, in peft's order: ``lora_B(lora_A(x)) * scaling``)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass
class LoraAdapter:
    """One adapter's weights keyed by (layer, TRT-LLM linear), plus what describes it."""

    name: str
    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # HF short names (q_proj, ...)
    pairs: dict[tuple[int, str], LoraPair] = field(default_factory=dict)
    layout: Optional["BaseLayout"] = field(default=None, repr=False)
    # how a worker rank of leader mode reads it: None, the PEFT directory at ``path``; else a tuple
    # (trtpipe.serving.triton_lora: a prefetched task's folder, or the tensors sent with a request)
    source: Optional[tuple] = field(default=None, repr=False)
    _shards: dict = field(default_factory=dict, repr=False)  # (layer, linear, rank, tp) -> LoraPair

    def pair(self, key: tuple[int, str], rank: int = 0, tp: int = 1) -> Optional[LoraPair]:
        """The pair of ``key`` as tp rank ``rank`` holds it (:func:`shard_pair`, computed once)."""
        whole = self.pairs.get(key)
        if whole is None or tp == 1:
            return whole
        got = self._shards.get((*key, rank, tp))
        if got is None:
            got = self._shards[(*key, rank, tp)] = shard_pair(whole, key[1], rank, tp, self.layout)
        return got

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.pairs.values())


@dataclass(frozen=True)
class BaseLayout:
    """What an adapter must match on the base model: per HF module of a layer (``self_attn.q_proj``), its TRT-LLM
    linear, its row offset there, its (out, in) shape; and the number of layers."""

    prefix: str  # "model.layers.{}."
    num_layers: int
    modules: dict[str, tuple[str, int, int, int]]  # hf module -> (trt linear, row offset, out, in)
    heads: tuple[int, int, int] = (0, 0, 0)  # attention heads, KV heads, head size (the qkv split at tp > 1)

    @classmethod
    def of(cls, hf_dir: Path) -> "BaseLayout":
        from trtpipe.checkpoint.hf_names import HFNames

        names = HFNames(Path(hf_dir))
        info = names.info
        ins = {
            "attention.qkv": info.hidden_size,
            "attention.dense": info.num_heads * info.head_dim,
            "mlp.fc": info.hidden_size,
            "mlp.gate": info.hidden_size,
            "mlp.proj": info.intermediate_size,
        }
        modules = {}
        for trt_rel, parts in names.layer.items():
            linear = trt_rel.rsplit(".", 1)[0]
            if not trt_rel.endswith(".weight") or linear not in LINEARS or trt_rel in names.experts:
                continue
            offset = 0
            for hf, rows in parts:
                modules[hf.rsplit(".", 1)[0]] = (linear, offset, rows, ins[linear])
                offset += rows
        if info.is_moe:  # the experts' linears are not in this table: an adapter on them is refused
            modules = {k: v for k, v in modules.items() if not v[0].startswith("mlp.")}
        return cls(names.prefix, info.num_layers, modules, (info.num_heads, info.num_kv_heads, info.head_dim))


def resolve_source(name: str, source: str, base_dir: Path) -> Path:
    """An adapter's directory: a path (relative to ``base_dir``) or an ``hf://`` repository (the hub cache)."""
    if source.startswith("hf://"):
        from trtpipe.models.hub import resolve_hf

        try:
            return resolve_hf(source)
        except CheckpointError as exc:
            raise CheckpointError(f"lora.adapters.{name}: {str(exc).split(': ', 1)[-1]}") from None
    p = Path(source).expanduser()
    return p if p.is_absolute() else (Path(base_dir) / p)


def read_adapter_config(name: str, path: Path) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, checked for what this runtime computes."""
    cfg_path = Path(path) / "adapter_config.json"
    try:
        cfg = load_json(cfg_path, AdapterError)
    except FileNotFoundError:
        raise AdapterError(f"adapter '{name}': {cfg_path} does not exist (not a PEFT adapter directory)") from None
    except ValueError as exc:
        raise AdapterError(f"adapter '{name}': {cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter '{name}': {cfg_path} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter '{name}': {cfg_path}: key 'peft_type' is {cfg.get('peft_type')!r}; only LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(f"adapter '{name}': {cfg_path}: key 'r' must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"adapter '{name}': {cfg_path}: key 'lora_alpha' must be a number, got {alpha!r}")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter '{name}': {cfg_path}: key 'bias' is {cfg['bias']!r}; only 'none' is served")
    for key, allowed in UNSUPPORTED.items():
        if key in cfg and cfg[key] not in allowed:
            raise AdapterError(f"adapter '{name}': {cfg_path}: key '{key}' is {cfg[key]!r}; not supported (LoRA only)")
    return cfg


def _weights(name: str, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    for f in WEIGHT_FILES:
        if (Path(path) / f).exists():
            try:
                return load_file(str(Path(path) / f))
            except Exception as exc:  # a truncated or foreign file: one line naming it
                raise AdapterError(f"adapter '{name}': {Path(path) / f} cannot be read: {exc}") from None
    raise AdapterError(f"adapter '{name}': {Path(path)} holds no {' or '.join(WEIGHT_FILES)}")


def target_modules(name: str, path: Path, layout: BaseLayout) -> tuple[str, ...]:
    """The HF short names (``q_proj``...) the adapter's tensors target, checked against the base (config only)."""
    cfg = read_adapter_config(name, path)
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    known = sorted({m.rsplit(".", 1)[-1] for m in layout.modules})
    if targets == ["all-linear"]:
        return tuple(known)
    bad = [t for t in targets if t not in known]
    if bad:
        raise AdapterError(
            f"adapter '{name}': {Path(path) / 'adapter_config.json'}: key 'target_modules' names "
            f"{', '.join(map(str, bad))}, which this model's linears ({', '.join(known)}) do not include"
        )
    return tuple(sorted(targets))


_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def load_adapter(name: str, path: Path, layout: BaseLayout, max_rank: Optional[int] = None) -> LoraAdapter:
    """Read a PEFT adapter and turn it into one :class:`LoraPair` per (layer, TRT-LLM linear).

    Raises:
        AdapterError: the adapter does not fit the base (a module it does not have, a shape that differs, a rank
            above ``max_rank``) or uses a PEFT feature this runtime does not compute.
    """
    cfg = read_adapter_config(name, path)
    r, alpha, rslora = int(cfg["r"]), float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))
    if max_rank is not None and r > max_rank:
        raise AdapterError(f"adapter '{name}': rank r={r} is above lora.max_lora_rank {max_rank}")
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    layer_re = re.compile("^" + re.escape(layout.prefix).replace(r"\{\}", r"(\d+)") + r"(.+)$")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _weights(name, path).items():
        m = _KEY.match(key)
        lm = layer_re.match(m.group("module")) if m else None
        if lm is None or lm.group(2) not in layout.modules:
            raise AdapterError(f"adapter '{name}': tensor '{key}' targets no linear of this base model")
        layer = int(lm.group(1))
        if layer >= layout.num_layers:
            raise AdapterError(
                f"adapter '{name}': tensor '{key}' names layer {layer}; the base has {layout.num_layers}"
            )
        found.setdefault((layer, lm.group(2)), {})[m.group("ab")] = t
    pieces: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(found.items()):
        linear, offset, out, fan_in = layout.modules[module]
        where = f"adapter '{name}': {module} of layer {layer}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{'A' if 'A' not in ab else 'B'} missing")
        a, b = ab["A"].float(), ab["B"].float()
        if a.shape != (r, fan_in) or b.shape != (out, r):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"(expected ({r}, {fan_in}) / ({out}, {r}) for r={r}): not an adapter of this model"
            )
        pieces.setdefault((layer, linear), []).append((offset, out, a, b))
    adapter = LoraAdapter(name, Path(path), r, alpha, rslora, target_modules(name, path, layout), layout=layout)
    for key, parts in pieces.items():
        adapter.pairs[key] = _fuse(parts, layout, key[1], scaling)
    return adapter


def adapter_of_modules(
    name: str, path: Path, modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], layout: BaseLayout
) -> LoraAdapter:
    """An adapter from per-(layer, HF module) pairs ``(a [r, in], b [out, r])`` whose ``b`` already holds the scaling
    (the engine path's ``lora_weights`` rows, :mod:`trtpipe.engine.lora_convert`): applied with scaling 1.

    Raises:
        AdapterError: a module the base does not have, or a pair that does not fit its sizes.
    """
    pieces: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), (a, b) in sorted(modules.items()):
        if module not in layout.modules or not 0 <= layer < layout.num_layers:
            raise AdapterError(f"adapter '{name}': {module} of layer {layer} is not a linear of this base model")
        linear, offset, out, fan_in = layout.modules[module]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != fan_in or b.shape[0] != out or a.shape[0] != b.shape[1]:
            raise AdapterError(
                f"adapter '{name}': {module} of layer {layer}: in {tuple(a.shape)} / out {tuple(b.shape)} do not fit "
                f"the base's ({fan_in} in, {out} out)"
            )
        pieces.setdefault((layer, linear), []).append((offset, out, a.float(), b.float()))
    rank = max((a.shape[0] for a, _ in modules.values()), default=0)
    targets = tuple(sorted({m.rsplit(".", 1)[-1] for _, m in modules}))
    adapter = LoraAdapter(name, Path(path), rank, float(rank), False, targets, layout=layout)  # alpha = r: scaling 1
    for key, parts in pieces.items():
        adapter.pairs[key] = _fuse(parts, layout, key[1], 1.0)
    return adapter


def _fuse(parts, layout: BaseLayout, linear: str, scaling: float) -> LoraPair:
    """One pair for a TRT-LLM linear from its targeted HF parts: A stacked, B block-diagonal at each part's rows."""
    total_out = sum(out for lin, _, out, _ in layout.modules.values() if lin == linear)
    rank = sum(a.shape[0] for _, _, a, _ in parts)
    a_all = torch.cat([a for _, _, a, _ in parts], dim=0)  # [R, in]
    b_all = torch.zeros(total_out, rank)  # [out, R]
    col = 0
    for offset, out, a, b in parts:
        b_all[offset : offset + out, col : col + a.shape[0]] = b
        col += a.shape[0]
    return LoraPair(a_all, b_all, scaling)


def shard_pair(pair: LoraPair, linear: str, rank: int, tp: int, layout: BaseLayout) -> LoraPair:
    """Tp rank ``rank``'s part of one linear's pair: ``lora_A`` split along its input for a row-parallel linear,
    ``lora_B`` along its output otherwise, by the rule that splits the base weight
    (``tensorrt_llm/lora_manager.py@007e181b``: "split by row" for attn_dense / mlp_4h_to_h, "split by column"
    else)."""
    from trtpipe.checkpoint.quant_layouts import STYLE
    from trtpipe.checkpoint.shard import Layout, split_linear_tensor

    num_heads, num_kv_heads, head_size = layout.heads
    split = Layout(num_heads, num_kv_heads, head_size, tp)
    what = f"LoRA {linear} at tp {tp}"
    if STYLE[linear] == "row":
        return LoraPair(
            split_linear_tensor(pair.a, "weight", "row", rank, split, what=what).contiguous(), pair.b, pair.scaling
        )
    style = "qkv" if linear == "attention.qkv" else STYLE[linear]
    return LoraPair(
        pair.a, split_linear_tensor(pair.b, "weight", style, rank, split, what=what).contiguous(), pair.scaling
    )


# --- applying adapters to a packed step ----------------------------------------------------------------------


class LoraContext:
    """Which packed tokens use which adapter during one forward (set by the step engine, read by every
    :class:`LoraLinear`). ``groups``: (adapter, row indices into the flattened tokens, or None for all of them)."""

    def __init__(self):
        self.groups: list[tuple[LoraAdapter, Optional[torch.Tensor]]] = []

    @contextmanager
    def use(self, groups: Sequence[tuple[LoraAdapter, Optional[torch.Tensor]]]) -> Iterator[None]:
        self.groups = list(groups)
        try:
            yield
        finally:
            self.groups = []


class LoraLinear(nn.Module):
    """A base linear plus the deltas of the adapters in :attr:`LoraContext.groups`: the base over all tokens once,
    then per adapter ``y[rows] += (x[rows] @ A^T) @ B^T``."""

    def __init__(self, base: nn.Module, key: tuple[int, str], context: LoraContext, rank: int = 0, tp: int = 1):
        super().__init__()
        self.base, self.key, self.context, self.rank, self.tp = base, key, context, rank, tp

    @property
    def weight(self):  # what calibration and the loaders read off a linear
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.context.groups
        if not groups:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [M, in], [M, out]
        for adapter, rows in groups:
            pair = adapter.pairs.get(self.key) if self.tp == 1 else adapter.pair(self.key, self.rank, self.tp)
            if pair is None:
                continue
            a, b = pair.a.to(x.dtype), pair.b.to(x.dtype)
            if rows is None:
                flat_y += ((flat_x @ a.t()) @ b.t()) * pair.scaling
            else:
                flat_y.index_add_(0, rows, ((flat_x.index_select(0, rows) @ a.t()) @ b.t()) * pair.scaling)
        return y


def attach(model) -> LoraContext:
    """Wrap every adaptable linear of a :class:`~trtpipe.runtime.model.ReferenceModel` (every tp rank's shard) or
    of a :class:`~trtpipe.runtime.distributed.RankModel` (its one shard) in a :class:`LoraLinear` of that shard's tp
    rank, sharing one :class:`LoraContext` (returned). Without groups set the model is unchanged."""
    tp = model.args.tp
    layout = getattr(model, "layout", None)  # a RankModel: one shard per layer, its tp rank
    ranks = [layout.tp_rank] if layout is not None else list(range(tp))
    context = LoraContext()
    for layer in model.layers:
        if len(layer.attention) != len(ranks):
            raise AdapterError(f"layer {layer.layer_idx} holds {len(layer.attention)} shards for tp ranks {ranks}")
        for linear, (owner, attr) in LINEARS.items():
            if owner == "mlp" and layer.is_moe:
                continue
            for rank, shard in zip(ranks, getattr(layer, owner)):
                base = getattr(shard, attr)
                if isinstance(base, LoraLinear):
                    raise AdapterError("LoRA is already attached to this model")
                setattr(shard, attr, LoraLinear(base, (layer.layer_idx, linear), context, rank, tp))
    return context


def whole_batch(adapter: Optional[LoraAdapter]) -> list[tuple[LoraAdapter, Optional[torch.Tensor]]]:
    """Groups that apply ``adapter`` to every token (none for the base model)."""
    return [] if adapter is None else [(adapter, None)]
