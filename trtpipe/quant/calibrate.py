"""Layer-sequential calibration: one decoder layer in memory at a time, all calibration activations through it.

Embed the samples once; then for each layer: load only its weights (from a memory-mapped source), run every
batch through it with observers on the linear inputs (per-channel max|x| and mean|x|; a token subsample and the
AWQ scale search when the algorithm needs them) and on the post-rope keys/values, pass the layer's outputs on
as the next layer's inputs, free the layer. Host memory: one layer plus two activation buffers, which spill to
memory-mapped files when larger than ``spill_bytes``. The statistics do not depend on the algorithm (except the
optional AWQ search), so one artifact serves fp8, int8_sq and the KV cache alike.
"""

from __future__ import annotations

import gc
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trtpipe.checkpoint.quant_layouts import LINEAR_GROUPS
from trtpipe.formats.primitives import observe_channel_amax
from trtpipe.errors import QuantizationError
from trtpipe.quant.awq import awq_clip, awq_scales, expert_awq
from trtpipe.quant.quantize import TORCH_DTYPES, GroupStats, LayerStats
from trtpipe.runtime.model import DecoderLayer, ModelArgs, rope_tables

log = logging.getLogger("trtpipe.quant")
# module name inside a layer -> the group whose input it reads (fc and gate share one observer)
_INPUT_OF = {m: g for g, (members, _) in LINEAR_GROUPS.items() for m in members}


class LayerSource(Protocol):
    """Unsharded float TRT-LLM tensors of a model, read one layer at a time (memory-mapped)."""

    args: ModelArgs  # unsharded (tp = pp = 1)

    def embedding(self) -> torch.Tensor: ...  # [V, H]

    def layer(self, i: int) -> dict[str, torch.Tensor]: ...  # names relative to transformer.layers.{i}.


@dataclass(frozen=True)
class CalibSettings:
    """What calibration collects. ``awq_group_size``: run the AWQ search at that group size (None: no AWQ)."""

    batch_size: int = 8
    awq_group_size: Optional[int] = None
    awq_tokens: int = 512  # tokens per input group kept for the AWQ search (MoE: per expert, E x that in all)
    spill_bytes: int = 1 << 30
    device: str = "cpu"


class ActivationBuffer:
    """``[N, T, H]`` float32 hidden states: in RAM, or a memory-mapped file when large."""

    def __init__(self, shape: tuple[int, ...], spill_bytes: int, spill_dir: Optional[Path] = None):
        nbytes = int(np.prod(shape)) * 4
        self._file = None
        if nbytes > spill_bytes:
            self._file = tempfile.NamedTemporaryFile(prefix="trtpipe-act-", suffix=".f32", dir=spill_dir)
            arr = np.memmap(self._file.name, dtype=np.float32, mode="w+", shape=shape)
            self.data = torch.from_numpy(arr)
        else:
            self.data = torch.empty(shape, dtype=torch.float32)

    @property
    def spilled(self) -> bool:
        return self._file is not None

    def close(self) -> None:
        self.data = None
        if self._file is not None:
            self._file.close()


class _Observer:
    """Forward pre-hooks on one layer's linears plus a KV observer; accumulates :class:`LayerStats` inputs."""

    def __init__(self, keep_tokens: int, total_tokens: int):
        self.amax: dict[str, torch.Tensor] = {}
        self.abssum: dict[str, torch.Tensor] = {}
        self.samples: dict[str, list[torch.Tensor]] = {}
        self.expert_amax: dict[str, torch.Tensor] = {}
        self.expert_channel_amax: dict[str, torch.Tensor] = {}  # group -> [E, in]
        # MoE + AWQ: per expert, the |x| sum and row count of the tokens routed to it, and a subsample of them
        self.expert_abssum: dict[str, torch.Tensor] = {}  # group -> [E, in]
        self.expert_rows: dict[str, torch.Tensor] = {}  # group -> [E]
        self.expert_samples: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.count = 0
        self.keep_tokens = keep_tokens
        self.keep_every = max(1, total_tokens // keep_tokens) if keep_tokens else 0
        self.k_amax = torch.zeros(1)
        self.v_amax = torch.zeros(1)
        self._kv_calls = 0

    def linear_hook(self, group: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # [tokens, in]
            a = observe_channel_amax(x).cpu()
            self.amax[group] = a if group not in self.amax else torch.maximum(self.amax[group], a)
            s = x.abs().sum(0).cpu()
            self.abssum[group] = s if group not in self.abssum else self.abssum[group] + s
            if self.keep_every:
                self.samples.setdefault(group, []).append(x[:: self.keep_every].cpu().clone())

        return hook

    def expert_hook(self, group: str, expert: int, num_experts: int, keep_every: int):
        """max |x| of the tokens one expert receives (its input rows: the router already chose them), overall and per
        channel (W4A8: the amax of x * pqs); with AWQ also their per-channel |x| sum and every ``keep_every``-th row,
        at most ``keep_tokens`` rows (bounded memory)."""

        def hook(module, args):
            if group not in self.expert_amax:
                self.expert_amax[group] = torch.zeros(num_experts)
                self.expert_channel_amax[group] = torch.zeros(num_experts, args[0].shape[-1])
            if not args[0].numel():
                return
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            c = observe_channel_amax(x).cpu()
            self.expert_channel_amax[group][expert] = torch.maximum(self.expert_channel_amax[group][expert], c)
            self.expert_amax[group][expert] = torch.maximum(self.expert_amax[group][expert], c.amax())
            if not self.keep_tokens:
                return
            if group not in self.expert_abssum:
                self.expert_abssum[group] = torch.zeros(num_experts, x.shape[-1])
                self.expert_rows[group] = torch.zeros(num_experts)
            self.expert_abssum[group][expert] += x.abs().sum(0).cpu()
            self.expert_rows[group][expert] += x.shape[0]
            kept = self.expert_samples.setdefault(group, {}).setdefault(expert, [])
            room = self.keep_tokens - sum(k.shape[0] for k in kept)
            if room > 0:
                kept.append(x[::keep_every][:room].cpu().clone())

        return hook

    def kv(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Stands in for the runtime's KV quantizer: records max|k| then max|v| (post-rope), changes nothing."""
        target = "k_amax" if self._kv_calls % 2 == 0 else "v_amax"
        setattr(self, target, torch.maximum(getattr(self, target), x.detach().abs().amax().float().cpu().reshape(1)))
        self._kv_calls += 1
        return x


def _attach(layer: DecoderLayer, obs: _Observer) -> list:
    handles = []
    prefix = f"transformer.layers.{layer.layer_idx}."
    for name, _rank, module in layer.named_linears():
        rel = name[len(prefix) :]
        if rel == "mlp.gate":  # reads the same input as mlp.fc: observe it once
            continue
        # every expert's fc / proj feeds the same group (one activation scale per MoE linear)
        handles.append(module.register_forward_pre_hook(obs.linear_hook(_INPUT_OF[rel])))
    if layer.is_moe:  # and each expert's own input statistics, for exports that scale experts one by one
        # an expert sees about top_k / E of the tokens: its own subsampling stride keeps ~awq_tokens of them
        keep_every = max(1, obs.keep_every * layer.top_k // layer.num_experts)
        for shard in layer.mlp:
            for j, (fc, proj) in enumerate(zip(shard.fc, shard.proj)):
                for module, rel in ((fc, "mlp.fc"), (proj, "mlp.proj")):
                    hook = obs.expert_hook(_INPUT_OF[rel], shard.first + j, layer.num_experts, keep_every)
                    handles.append(module.register_forward_pre_hook(hook))
    for shard in layer.attention:
        shard.kv_quant, shard.kv_scale = obs.kv, torch.ones(1)
    return handles


def _stats(obs: _Observer, tokens: int, layer_tensors: dict, settings: CalibSettings, model_dtype: str) -> LayerStats:
    st = LayerStats(k_amax=obs.k_amax, v_amax=obs.v_amax)
    for group, (members, _) in LINEAR_GROUPS.items():
        if group not in obs.amax:
            raise QuantizationError(f"calibration: no input observed for {group}")
        g = GroupStats(
            amax=obs.amax[group],
            absmean=obs.abssum[group] / tokens,
            expert_amax=obs.expert_amax.get(group),
            expert_channel_amax=obs.expert_channel_amax.get(group),
        )
        if g.expert_amax is not None and bool((g.expert_amax == 0).any()):
            idle = (g.expert_amax == 0).nonzero().flatten().tolist()
            log.warning(
                "calibration: no token reached expert(s) %s of %s; their input scale falls back to the "
                "whole MoE input's amax",
                idle,
                group,
            )
        in_features = g.amax.numel()
        stacked = [m for m in members if layer_tensors.get(f"{m}.weight", torch.empty(0)).dim() == 3]
        if settings.awq_group_size and in_features % settings.awq_group_size == 0 and stacked:  # MoE experts
            _expert_awq_stats(obs, group, g, stacked, layer_tensors, settings, model_dtype)
        elif settings.awq_group_size and in_features % settings.awq_group_size == 0:  # else it cannot be int4
            dev, gs = settings.device, settings.awq_group_size
            samples = torch.cat(obs.samples[group]).to(dev)
            ws = [layer_tensors[f"{m}.weight"].to(dev) for m in members]
            pqs = awq_scales(samples, g.absmean.to(dev), ws, gs)[0]
            pqs = pqs.to(TORCH_DTYPES[model_dtype]).float()  # rounded as it is stored (model dtype)
            g.awq_pqs = pqs.cpu()
            for m, w in zip(members, ws):
                g.awq_amax[m] = awq_clip(samples * pqs, w.float() / pqs, gs).cpu()
        st.groups[group] = g
    return st


def _expert_awq_stats(
    obs: _Observer,
    group: str,
    g: GroupStats,
    members: list[str],
    layer_tensors: dict,
    settings: CalibSettings,
    model_dtype: str,
) -> None:
    """The AWQ result of a MoE linear (:func:`trtpipe.quant.awq.expert_awq`): the experts' shared pre-quant scale and
    each expert's clipped amax, stacked ``[E, out, in/g]`` per member, from the tokens routed to each expert."""
    dev, gs = settings.device, settings.awq_group_size
    ws = [layer_tensors[f"{m}.weight"].to(dev) for m in members]
    num_experts = ws[0].shape[0]
    kept = obs.expert_samples.get(group, {})
    rows = obs.expert_rows.get(group, torch.zeros(num_experts))
    samples = [torch.cat(kept[e]).to(dev) if e in kept and rows[e] > 0 else None for e in range(num_experts)]
    means = [
        (obs.expert_abssum[group][e] / rows[e]).to(dev) if samples[e] is not None else None for e in range(num_experts)
    ]
    pqs, amax, idle = expert_awq(samples, means, ws, gs, TORCH_DTYPES[model_dtype])
    if idle:
        log.warning(
            "calibration: no token reached expert(s) %s of %s; their AWQ weights fall back to plain "
            "per-group max-abs int4 scales for the layer's shared pre-quant scale",
            idle,
            group,
        )
    g.awq_pqs = pqs.cpu()
    offset = 0
    for m, w in zip(members, ws):
        g.awq_amax[m] = torch.stack([a[offset : offset + w.shape[1]] for a in amax]).cpu()
        offset += w.shape[1]


def calibrate(
    source: LayerSource,
    tokens: torch.Tensor,
    settings: CalibSettings,
    on_layer: Optional[Callable[[int, LayerStats], None]] = None,
    progress: Optional[Callable[[str], None]] = None,
    spill_dir: Optional[Path] = None,
) -> list[LayerStats]:
    """Run layer-sequential calibration.

    Args:
        source: the model's unsharded float tensors, one layer at a time.
        tokens: ``[N, T]`` calibration token ids.
        settings: what to collect.
        on_layer: called with each layer's statistics as soon as they exist (e.g. to write them).
        progress: called with "(i/N) Calibrating" labels.

    Returns:
        Per-layer statistics.
    """
    args, dev = source.args, settings.device
    n, t = tokens.shape
    buf_in = ActivationBuffer((n, t, args.hidden_size), settings.spill_bytes, spill_dir)
    buf_out = ActivationBuffer((n, t, args.hidden_size), settings.spill_bytes, spill_dir)
    emb = source.embedding()
    for lo in range(0, n, settings.batch_size):
        # times Gemma's sqrt(hidden) (1 for other models), as the engine's embedding lookup scales it
        buf_in.data[lo : lo + settings.batch_size] = (
            torch.nn.functional.embedding(tokens[lo : lo + settings.batch_size], emb).float() * args.embed_scale
        )
    del emb
    cos_sin = {key: tuple(c.to(dev) for c in cs) for key, cs in rope_tables(args.ropes(), 0, t).items()}
    out: list[LayerStats] = []
    try:
        for i in range(args.num_layers):
            if progress:
                progress(f"({i + 1}/{args.num_layers}) Calibrating")
            tensors = source.layer(i)
            for k in list(tensors):  # one tensor at a time, so the source copy is freed as we go
                tensors[k] = tensors[k].to(dev, torch.float32)
            layer = DecoderLayer.from_unsharded(args, tensors, i)  # shares these float32 storages
            obs = _Observer(settings.awq_tokens if settings.awq_group_size else 0, n * t)
            handles = _attach(layer, obs)
            with torch.no_grad():
                for lo in range(0, n, settings.batch_size):
                    x = buf_in.data[lo : lo + settings.batch_size].to(dev)
                    buf_out.data[lo : lo + settings.batch_size] = layer(x, 0, None, cos_sin).cpu()
            for h in handles:
                h.remove()
            stats = _stats(obs, n * t, tensors, settings, args.dtype)
            out.append(stats)
            if on_layer:
                on_layer(i, stats)
            del layer, tensors, obs
            gc.collect()
            buf_in, buf_out = buf_out, buf_in  # this layer's outputs are the next one's inputs
    finally:
        buf_in.close()
        buf_out.close()
    return out


# --- the statistics artifact ----------------------------------------------------------------------------------

STATS_FILE = "layer{}.safetensors"


def save_layer_stats(out_dir: Path, i: int, st: LayerStats) -> None:
    t = {"k_amax": st.k_amax, "v_amax": st.v_amax}
    for group, g in st.groups.items():
        for key in ("amax", "absmean", "awq_pqs", "expert_amax", "expert_channel_amax"):
            v = getattr(g, key, None)
            if v is not None:
                t[f"{group}.{key}"] = v.contiguous()
        for m, v in g.awq_amax.items():
            t[f"{group}.awq_amax.{m}"] = v.contiguous()
    save_file(t, str(out_dir / STATS_FILE.format(i)))


def load_layer_stats(stats_dir: Path, i: int) -> LayerStats:
    path = stats_dir / STATS_FILE.format(i)
    if not path.exists():
        raise QuantizationError(f"{path}: calibration statistics for layer {i} are missing (re-run trtpipe calibrate)")
    t = load_file(str(path))
    st = LayerStats(k_amax=t["k_amax"], v_amax=t["v_amax"])
    for group in LINEAR_GROUPS:
        g = GroupStats(amax=t[f"{group}.amax"], absmean=t.get(f"{group}.absmean"))
        g.awq_pqs = t.get(f"{group}.awq_pqs")
        g.expert_amax = t.get(f"{group}.expert_amax")
        g.expert_channel_amax = t.get(f"{group}.expert_channel_amax")
        g.awq_amax = {
            k[len(group) + len(".awq_amax.") :]: v for k, v in t.items() if k.startswith(f"{group}.awq_amax.")
        }
        st.groups[group] = g
    return st


def write_meta(out_dir: Path, meta: dict) -> None:
    (out_dir / "stats.json").write_text(json.dumps(meta, indent=2) + "\n")
