"""The reference model: a gpt-fast style decoder that runs TensorRT-LLM checkpoint shards on CPU in float32.

Parameter names are TensorRT-LLM's (``attention.qkv``, ``mlp.fc``/``mlp.gate``/``mlp.proj``, ``ln_f``).
Tensor parallelism is simulated in one process: every layer holds one module per tp rank, column-parallel
outputs stay per rank (each rank's heads/experts), row-parallel partial outputs are summed (the all-reduce)
and their bias is added once. Pipeline ranks are just consecutive slices of ``layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from trtpipe.checkpoint.quant_layouts import SHARED_BY_EXPERTS
from trtpipe.errors import CheckpointError
from trtpipe.models import REGISTRY
from trtpipe.models.dims import MLA, checkpoint_dims
from trtpipe.models.trtllm_config import resolve_moe_sizes
from trtpipe.runtime.linear import LinearSpec, build_linear, kv_quant, module_quant_algo
from trtpipe.runtime.mla import MLAAttentionShard, group_limited_route
from trtpipe.runtime.rope import Rope, apply_rope


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (HF ``gelu_pytorch_tanh``, Gemma's MLP activation)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "silu": F.silu,
    "swiglu": F.silu,
    "gelu": F.gelu,
    "gelu_new": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_tanh": gelu_tanh,
}

SLIDING, FULL = "sliding_attention", "full_attention"
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def embedding_scale(architecture: str, hidden: int, dtype: str) -> float:
    """A family with ``scaled_embedding`` (Gemma) multiplies the embedding by sqrt(hidden) rounded to the weight dtype
    first (transformers ``Gemma3TextScaledWordEmbedding``: ``embed_scale.to(weight.dtype)``; TensorRT-LLM's Gemma
    model scales the embedding output the same way); 1 for every other architecture.
    bf16: sqrt(5376) = 73.32 -> 73.5."""
    family = REGISTRY.get(architecture)
    if family is None or not family.scaled_embedding:
        return 1.0
    return float(torch.tensor(math.sqrt(hidden), dtype=TORCH_DTYPES.get(dtype, torch.float32)).item())


@dataclass(frozen=True)
class ModelArgs:
    """The numbers of a TRT-LLM ``config.json`` the forward pass needs, with the per-rank sizes derived."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float = 1e-5
    hidden_act: str = "silu"
    rotary_base: float = 10000.0
    rotary_scaling: Optional[dict] = None
    rotary_dim: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    sliding_window: Optional[int] = None
    num_experts: int = 0
    top_k: int = 0
    moe_renormalize: bool = True  # moe.normalization_mode 1 (RENORMALIZE); 0 (NONE) keeps the full-softmax weights
    tp: int = 1
    pp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    attention_dp: bool = False  # every rank its own requests, whole attention; the experts split (runtime.distributed)
    dtype: str = "float32"
    quantization: Optional[dict] = None
    quant_cfg: Optional[dict] = None
    # Gemma 3: per-layer sliding/global attention, a second (local, unscaled) rope base, the attention scale
    # query_pre_attn_scalar ** -0.5, norms around attention output and MLP (inter_layernorms), scaled embedding.
    layer_types: tuple[str, ...] = ()
    rope_local_base: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    inter_layernorms: bool = False
    embed_scale: float = 1.0
    final_logit_softcapping: Optional[float] = None
    # gpt-oss: clamped SwiGLU experts, ((up + 1) * g * sigmoid(alpha * g)) with g = min(gate, limit) (see clamped_swiglu)
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.0
    # DeepSeek-V3 (trtpipe.runtime.mla): latent attention, leading dense layers, shared experts, sigmoid group routing
    mla: Optional[MLA] = None
    dense_layers: int = 0
    shared_experts: bool = False
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    rope_interleave: bool = False

    @classmethod
    def from_config(cls, cfg: dict, quant_cfg: Optional[dict] = None) -> "ModelArgs":
        """The dimensions (:func:`~trtpipe.models.dims.checkpoint_dims`) and the checkpoint's mapping, dtype and
        quantization of a TensorRT-LLM checkpoint config.json."""
        d = checkpoint_dims(cfg)
        mapping = cfg.get("mapping") or {}
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        moe_ep, moe_tp = resolve_moe_sizes(tp, int(mapping.get("moe_ep_size", -1)), int(mapping.get("moe_tp_size", -1)))
        if d.layer_types and set(d.layer_types) - {SLIDING, FULL}:
            raise CheckpointError(
                f"config.json: key 'layer_types' must list {SLIDING} or {FULL} for each of {d.num_layers} layers"
            )
        if d.attn_logit_softcapping is not None:
            raise CheckpointError(
                "config.json: key 'attn_logit_softcapping' is set; the reference runtime does not "
                "softcap attention logits"
            )
        return cls(
            vocab_size=d.vocab_size,
            hidden_size=d.hidden_size,
            num_layers=d.num_layers,
            num_heads=d.num_heads,
            num_kv_heads=d.num_kv_heads,
            head_size=d.head_dim,
            intermediate_size=d.intermediate_size,
            norm_epsilon=d.rms_norm_eps,
            hidden_act=d.hidden_act,
            rotary_base=d.rope_theta,
            rotary_scaling=d.rope_scaling,
            rotary_dim=d.rotary_dim,
            max_position_embeddings=d.max_position_embeddings,
            sliding_window=d.sliding_window,
            num_experts=d.num_experts if d.is_moe else 0,
            top_k=d.experts_per_token,
            moe_renormalize=d.moe_renormalize,
            tp=tp,
            pp=pp,
            moe_tp=moe_tp,
            moe_ep=moe_ep,
            attention_dp=bool(mapping.get("enable_attention_dp", False)),
            dtype=d.torch_dtype,
            quantization=cfg.get("quantization") or {},
            quant_cfg=quant_cfg,
            layer_types=d.layer_types,
            rope_local_base=d.rope_local_theta,
            query_pre_attn_scalar=d.query_pre_attn_scalar,
            inter_layernorms=bool(cfg.get("inter_layernorms", False)),
            embed_scale=embedding_scale(d.architecture, d.hidden_size, d.torch_dtype),
            final_logit_softcapping=d.final_logit_softcapping,
            swiglu_limit=None if d.swiglu_limit is None else float(d.swiglu_limit),
            swiglu_alpha=1.0 if d.swiglu_alpha is None else float(d.swiglu_alpha),
            mla=d.mla,
            dense_layers=d.dense_layers if d.is_moe else 0,
            shared_experts=d.shared_experts > 0,
            moe_scoring=d.moe_scoring,
            moe_groups=d.moe_groups,
            moe_topk_groups=d.moe_topk_groups,
            routed_scaling_factor=d.routed_scaling_factor,
            rope_interleave=d.rope_interleave,
        )

    def unsharded(self) -> "ModelArgs":
        """The same model seen as tp=1, pp=1 (for tensors before sharding, e.g. layer-by-layer calibration)."""
        return replace(self, tp=1, pp=1, moe_tp=1, moe_ep=1, attention_dp=False)

    def whole(self) -> "ModelArgs":
        """The numbers of the modules every attention-DP rank holds whole (attention, dense MLP, shared experts)."""
        return replace(self, tp=1)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return -(-self.num_kv_heads // self.tp)  # ceil: KV heads are replicated when fewer than tp

    def rope(self) -> Rope:
        """The rope of global layers (of every layer in models without sliding ones)."""
        return Rope(
            self.rotary_dim or self.head_size, self.rotary_base, self.rotary_scaling, self.max_position_embeddings
        )

    def ropes(self) -> dict[str, Rope]:
        """Rope by key (``rope_key``): "global", and "local" (base ``rope_local_base_freq``, no scaling) when the
        sliding layers have their own base (Gemma 3)."""
        out = {"global": self.rope()}
        if self.rope_local_base is not None and SLIDING in self.layer_types:
            out["local"] = Rope(
                self.rotary_dim or self.head_size, float(self.rope_local_base), None, self.max_position_embeddings
            )
        return out

    def rope_key(self, layer: int) -> str:
        if self.rope_local_base is not None and self.layer_types and self.layer_types[layer] == SLIDING:
            return "local"
        return "global"

    def window(self, layer: int) -> Optional[int]:
        """Layer's attention window: every layer's ``sliding_window`` (Mistral), or only sliding layers' (Gemma 3)."""
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """Gemma: query_pre_attn_scalar ** -0.5 (the engine's q_scaling = sqrt(qpas)/sqrt(head_size)); else head_size ** -0.5."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_size) ** -0.5


def rope_tables(ropes: dict[str, Rope], start_pos, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin of every rope a model's layers use, keyed as :meth:`ModelArgs.ropes` (what layers receive)."""
    return {key: rope.cos_sin_for(start_pos, length) for key, rope in ropes.items()}


def softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``tanh(z / cap) * cap`` when the model sets a final-logit softcap (Gemma 2; null in Gemma 3)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention_probs(scores: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax over the key axis (last) of masked scores. With attention sinks (gpt-oss: one learned logit per
    query head, ``sinks`` broadcastable to ``scores[..., :1]``) the sink is one more column of the softmax, dropped
    after it, so each row sums to less than 1 (transformers' ``eager_attention_forward`` of gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``(u + 1) * g * sigmoid(alpha * g)`` (transformers ``GptOssExperts._apply_gate``)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class KVCache:
    """Keys and values per (layer, tp rank): [B, kv_heads_r, S, d], grown by concatenation.

    Every row of the batch sits at the same positions (one ``start_pos``); see :class:`BatchKVCache` for rows
    at different positions.
    """

    def __init__(self):
        self.store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key: tuple[int, int], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self.store:
            k0, v0 = self.store[key]
            k, v = torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2)
        self.store[key] = (k, v)
        return k, v


class BatchKVCache:
    """Keys and values of sequences at different positions, gpt-fast style: preallocated [B, kv_heads_r, S_max, d]
    per (layer, tp rank) where row b's key of position p sits at index p.

    Why: batched decoding feeds one token per row at per-row positions; with index == position, a row's
    causal mask also hides the unused slots past its length (the padding of shorter rows).
    """

    def __init__(self, store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]):
        self.store = store

    @classmethod
    def from_caches(cls, caches: list[KVCache], max_len: int) -> "BatchKVCache":
        """Stack per-sequence caches (one row each, e.g. after per-sequence prefill) right-padded to ``max_len``."""
        store = {}
        for key, (k0, v0) in caches[0].store.items():
            _, nkv, _, d = k0.shape
            k = torch.zeros(len(caches), nkv, max_len, d, dtype=k0.dtype, device=k0.device)  # [B, nkv, S_max, d]
            v = k.new_zeros(*k.shape[:-1], v0.shape[-1])  # MLA caches a latent as k and nothing as v
            for b, c in enumerate(caches):
                ck, cv = c.store[key]  # [1, nkv, S_b, d]
                k[b, :, : ck.shape[2]], v[b, :, : cv.shape[2]] = ck[0], cv[0]
            store[key] = (k, v)
        return cls(store)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (e.g. drop finished sequences), in this order."""
        self.store = {key: (k[rows], v[rows]) for key, (k, v) in self.store.items()}

    def update(
        self, key: tuple[int, int], k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, nkv, T, d] at positions pos [B, T]; return the cache up to the longest row [B, nkv, S, d]."""
        ck, cv = self.store[key]
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        ck[rows, :, pos] = k.transpose(1, 2)  # index [B, T] -> values [B, T, nkv, d]
        cv[rows, :, pos] = v.transpose(1, 2)
        S = int(pos.max()) + 1
        return ck[:, :, :S], cv[:, :, :S]


def positions(start_pos, T: int, device=None) -> torch.Tensor:
    """Positions of T new tokens: [1, T] for one int ``start_pos``, [B, T] for per-row starts (LongTensor [B])."""
    if isinstance(start_pos, torch.Tensor) and start_pos.dim() == 1:
        return start_pos.to(device)[:, None] + torch.arange(T, device=device)  # [B, T]
    return torch.arange(int(start_pos), int(start_pos) + T, device=device)[None]  # [1, T]


def _linear(tensors: dict, prefix: str, name: str, style: str, args: ModelArgs, rank: int) -> nn.Module:
    """Build ``prefix+name`` of one rank; row-parallel linears get no bias (added after the all-reduce)."""
    sub = {k[len(name) + 1 :]: t for k, t in tensors.items() if k.startswith(name + ".")}
    if style == "row":
        sub.pop("bias", None)
    full = prefix + name
    spec = LinearSpec(
        full,
        module_quant_algo(full, args.quantization, args.quant_cfg),
        args.quantization or {},
        args.dtype,
        style,
        rank,
        args.tp,
    )
    return build_linear(sub, spec)


class AttentionShard(nn.Module):
    """One tp rank's attention: its fused qkv heads, causal (optionally windowed) softmax, its slice of dense."""

    def __init__(self, tensors: dict, prefix: str, args: ModelArgs, rank: int, layer_idx: Optional[int] = None):
        super().__init__()
        self.nh, self.nkv, self.d = args.heads_per_rank, args.kv_heads_per_rank, args.head_size
        self.qkv = _linear(tensors, prefix, "attention.qkv", "column", args, rank)
        self.dense = _linear(tensors, prefix, "attention.dense", "row", args, rank)
        self.window = args.sliding_window if layer_idx is None else args.window(layer_idx)
        self.scale = args.attention_scale
        self.sinks = _opt_float(tensors.get("attention.sinks"))  # gpt-oss: [heads of this rank]
        # Qwen3: RMSNorm of each q and k head over head_size before RoPE (one weight shared by the heads).
        self.q_norm = _opt_float(tensors.get("attention.q_layernorm.weight"))
        self.k_norm = _opt_float(tensors.get("attention.k_layernorm.weight"))
        if (self.q_norm is None) != (self.k_norm is None):
            raise CheckpointError(
                f"checkpoint: '{prefix}attention.q_layernorm.weight' and "
                f"'{prefix}attention.k_layernorm.weight' come together; one is missing"
            )
        self.eps = args.norm_epsilon
        self.kv_quant = kv_quant((args.quantization or {}).get("kv_cache_quant_algo"))
        self.kv_scale = tensors.get("attention.kv_cache_scaling_factor")
        if self.kv_scale is None and "attention.k_cache_scaling_factor" in tensors:  # merged as TRT-LLM's loader does
            self.kv_scale = torch.maximum(
                tensors["attention.k_cache_scaling_factor"], tensors["attention.v_cache_scaling_factor"]
            )
        if self.kv_quant is not None and self.kv_scale is None:
            raise CheckpointError(f"checkpoint: tensor '{prefix}attention.kv_cache_scaling_factor' is missing")

    def forward(self, x, cos, sin, start_pos, cache, key):
        """x: [B, T, H] at positions start_pos.. (one int, or a LongTensor [B] of per-row starts)."""
        B, T, _ = x.shape
        qkv = self.qkv(x)  # [B, T, (nh + 2 nkv) d]
        q, k, v = qkv.split([self.nh * self.d, self.nkv * self.d, self.nkv * self.d], dim=-1)
        q = q.view(B, T, self.nh, self.d).transpose(1, 2)  # [B, nh, T, d]
        k = k.view(B, T, self.nkv, self.d).transpose(1, 2)  # [B, nkv, T, d]
        v = v.view(B, T, self.nkv, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, self.kv_scale.float()), self.kv_quant(v, self.kv_scale.float())
        if hasattr(cache, "attend"):  # a paged KV pool (the serving executor's packed steps) does the attention
            return self.dense(cache.attend(key, q, k, v, self.window, self.scale, self.sinks))
        q_pos = positions(start_pos, T, x.device)  # [B|1, T]
        if isinstance(cache, BatchKVCache):
            k, v = cache.update(key, k, v, q_pos)  # [B, nkv, S, d], index == position, padding past each row's end
            k_pos = torch.arange(k.shape[2], device=x.device)[None]  # [1, S]
        else:
            if cache is not None:
                k, v = cache.update(key, k, v)  # [B, nkv, S, d]
            S = k.shape[2]
            k_pos = q_pos[:, -1:] + 1 - S + torch.arange(S, device=x.device)  # [B|1, S]: the cache holds the S latest
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        allowed = k_pos[:, None, :] <= q_pos[:, :, None]  # [B|1, T, S] causal per row; hides padding too
        if self.window:
            allowed &= (q_pos[:, :, None] - k_pos[:, None, :]) < self.window
        scores = q @ k.transpose(-1, -2)  # [B, nh, T, S]
        scores = scores / math.sqrt(self.d) if self.scale == self.d**-0.5 else scores * self.scale
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sinks = None if self.sinks is None else self.sinks.view(1, -1, 1, 1)
        out = attention_probs(scores, sinks) @ v  # [B, nh, T, d]
        return self.dense(out.transpose(1, 2).reshape(B, T, self.nh * self.d))  # partial [B, T, H]


class GatedMLPShard(nn.Module):
    """proj( act(fc(x)) * gate(x) ): fc is the activated branch (HF gate_proj), gate the linear one (up_proj)."""

    def __init__(self, tensors: dict, prefix: str, args: ModelArgs, rank: int, name: str = "mlp"):
        super().__init__()
        self.fc = _linear(tensors, prefix, f"{name}.fc", "column", args, rank)
        self.gate = _linear(tensors, prefix, f"{name}.gate", "column", args, rank)
        self.proj = _linear(tensors, prefix, f"{name}.proj", "row", args, rank)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x):
        return self.proj(self.act(self.fc(x)) * self.gate(x))  # partial [B, T, H]


def _expert_slice(tensors: dict, e: int, num_local: int) -> dict:
    """Expert e's tensors: per-expert tensors ([E_r, ...]) are indexed, shared ones (e.g. [1] scales) kept; a tensor
    the experts share (SHARED_BY_EXPERTS, the pre-quant scale) stored 2-D ([E, in] as ModelOpt stacks it, [1, in])
    is read as trtllm-build reads it, its row 0 for every expert (trtpipe.checkpoint.quant_layouts)."""

    def pick(k: str, t: torch.Tensor) -> torch.Tensor:
        if k in SHARED_BY_EXPERTS and t.dim() == 2:
            return t[0]
        return t[e] if t.dim() >= 2 and t.shape[0] == num_local else t

    return {k: pick(k, t) for k, t in tensors.items()}


class MoEShard(nn.Module):
    """One tp rank's experts: a contiguous block of E/moe_ep experts, each holding I/moe_tp of the hidden units.

    Expert biases (gpt-oss): fc's bias is split with fc; proj's ([E, H], row-parallel) is added once per expert,
    weighted like the expert's output, by the first moe_tp rank of the expert's group (the all-reduce sums the rest)."""

    def __init__(self, tensors: dict, prefix: str, args: ModelArgs, rank: int):
        super().__init__()
        ep_rank, num_local = rank % args.moe_ep, args.num_experts // args.moe_ep
        self.first = ep_rank * num_local
        act = ACTIVATIONS[args.hidden_act]
        limit, alpha = args.swiglu_limit, args.swiglu_alpha
        self.glu = (lambda g, u: act(g) * u) if limit is None else (lambda g, u: clamped_swiglu(g, u, alpha, limit))
        fc = {k[len("mlp.fc.") :]: t for k, t in tensors.items() if k.startswith("mlp.fc.")}
        proj = {k[len("mlp.proj.") :]: t for k, t in tensors.items() if k.startswith("mlp.proj.")}
        bias = proj.pop("bias", None)
        self.proj_bias = _opt_float(bias) if rank // args.moe_ep == 0 else None  # [E_r, H], first moe_tp rank only
        self.fc, self.proj = nn.ModuleList(), nn.ModuleList()
        # TensorRT-LLM quantizes a MoE layer as a whole, and leaves it in float only when exclude_modules matches the
        # MixtureOfExperts module itself (``...mlp``), not its fc / proj (NVIDIA/TensorRT-LLM@89fd9b74
        # tensorrt_llm/quantization/quantize.py quantize_layers): so the experts' algorithm is the layer's
        algo = module_quant_algo(f"{prefix}mlp", args.quantization, args.quant_cfg)
        for e in range(num_local):
            for store, sub, name, style in ((self.fc, fc, "mlp.fc", "column"), (self.proj, proj, "mlp.proj", "row")):
                full = f"{prefix}{name}"
                spec = LinearSpec(full, algo, args.quantization or {}, args.dtype, style, rank, args.tp)
                store.append(build_linear(_expert_slice(sub, e, num_local), spec))

    def forward(self, x, weights):
        """x: [N, H]; weights: [N, E] routing weights (0 for unselected experts)."""
        out = torch.zeros_like(x)
        for i, (fc, proj) in enumerate(zip(self.fc, self.proj)):
            rows = weights[:, self.first + i].nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            up, gate = fc(x[rows]).chunk(2, dim=-1)  # [w3 (linear); w1 (activated)]
            y = proj(self.glu(gate, up))
            if self.proj_bias is not None:
                y = y + self.proj_bias[i]
            out.index_add_(0, rows, y * weights[rows, self.first + i, None])
        return out  # partial [N, H]


def route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool = True, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Softmax over experts in float32 (or wider), keep top_k; with ``renormalize`` (TRT-LLM RENORMALIZE, HF
    Mixtral and Qwen3-MoE's ``norm_topk_prob``) the kept weights are divided by their sum, else (NONE) they stay the
    full softmax's. ``bias``: the router's (gpt-oss); a softmax over the top-k logits, as gpt-oss computes it, equals
    the renormalized full softmax. Returns [N, E]."""
    dt = torch.promote_types(x.dtype, torch.float32)  # float64 when the model runs as a float64 oracle
    logits = x.to(dt) @ router.to(dt).t()
    probs = torch.softmax(logits if bias is None else logits + bias.to(dt), dim=-1)  # [N, E]
    top, idx = probs.topk(top_k, dim=-1)
    return torch.zeros_like(probs).scatter_(-1, idx, top / top.sum(-1, keepdim=True) if renormalize else top)


class DecoderLayer(nn.Module):
    """One decoder layer over all tp ranks' shards of it.

    Args:
        args: model numbers (``args.tp`` = len(rank_tensors)).
        rank_tensors: per tp rank, that rank's tensors of this layer keyed relative to the layer
            (``attention.qkv.weight``, ``mlp.fc.weight``...).
        layer_idx: global layer index (names the modules for quantization rules and keys the KV cache).
        all_reduce: sums the tp ranks' partials (one process per rank; identity when all shards are here).
        moe_exchange: under attention data parallel (``args.attention_dp``), ``fn(tokens, experts) -> output``: runs
            ``experts`` (this process's routed experts over some tokens) on every rank's tokens and returns this
            rank's rows of the sum (one process per rank: :meth:`~trtpipe.runtime.distributed.Comm.moe_exchange`);
            default: ``experts(tokens)``, all experts being here.
    """

    def __init__(
        self,
        args: ModelArgs,
        rank_tensors: list[dict],
        layer_idx: int,
        rope: Optional[Rope | dict[str, Rope]] = None,
        tp_ranks: Optional[list[int]] = None,
        all_reduce=None,
        moe_exchange=None,
    ):
        super().__init__()
        tp_ranks = list(range(args.tp)) if tp_ranks is None else list(tp_ranks)
        if len(rank_tensors) != len(tp_ranks):
            raise CheckpointError(f"layer {layer_idx}: {len(rank_tensors)} rank shards for tp={args.tp}")
        prefix = f"transformer.layers.{layer_idx}."
        self.layer_idx, self.eps, self.top_k, self.renormalize = (
            layer_idx,
            args.norm_epsilon,
            args.top_k,
            args.moe_renormalize,
        )
        # the layer's rope: "local" for Gemma's sliding layers, else "global" (one Rope passed = the global one)
        self.rope_key = args.rope_key(layer_idx)
        ropes = rope if isinstance(rope, dict) else {"global": rope or args.rope()}
        if self.rope_key not in ropes:
            ropes = {**ropes, **{k: r for k, r in args.ropes().items() if k not in ropes}}
        self.rope = ropes[self.rope_key]
        t0 = rank_tensors[0]
        # Attention DP (NVIDIA/TensorRT-LLM@000561df tensorrt_llm/_torch/models/modeling_deepseekv3.py: no attention
        # all-reduce, the dense MLP and the shared experts at tp 1): every rank holds those whole, so one copy
        # (rank_tensors[0]'s) runs them; only the routed experts are split over the ranks.
        self.attention_dp = args.attention_dp
        own = args.whole() if self.attention_dp else args
        owned = [(0, t0)] if self.attention_dp else list(zip(tp_ranks, rank_tensors))
        # inter_layernorms (Gemma): post_layernorm normalizes the attention OUTPUT, the MLP has its own pre/post
        # norms; otherwise (Llama) post_layernorm is the norm before the MLP.
        self.inter_layernorms = args.inter_layernorms
        norms = ("input_layernorm.weight", "post_layernorm.weight")
        if self.inter_layernorms:
            norms += ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        for name in norms:
            if name not in t0:
                raise CheckpointError(f"checkpoint: tensor '{prefix}{name}' is missing")
        self.input_ln = t0["input_layernorm.weight"].float()
        self.post_ln = t0["post_layernorm.weight"].float()
        self.pre_ff_ln = _opt_float(t0.get("pre_feedforward_layernorm.weight")) if self.inter_layernorms else None
        self.post_ff_ln = _opt_float(t0.get("post_feedforward_layernorm.weight")) if self.inter_layernorms else None
        if args.mla is not None:  # DeepSeek-V3's latent attention (trtpipe.runtime.mla)
            self.attention = nn.ModuleList(MLAAttentionShard(t, prefix, own, r, _linear) for r, t in owned)
        else:
            self.attention = nn.ModuleList(AttentionShard(t, prefix, own, r, layer_idx) for r, t in owned)
        # One process per rank (trtpipe.runtime.distributed) holds one shard and sums the others' partials here.
        self.all_reduce = _identity if self.attention_dp or all_reduce is None else all_reduce
        self.moe_exchange = moe_exchange or _run_here
        self.dense_bias = _opt_float(t0.get("attention.dense.bias"))
        self.is_moe, self.num_experts = args.num_experts > 0 and layer_idx >= args.dense_layers, args.num_experts
        self.routing = args  # group-limited sigmoid routing reads its sizes from here (DeepSeek-V3)
        self.shared = None  # DeepSeek-V3's shared experts: a gated MLP every token goes through
        if self.is_moe:
            if "mlp.router.weight" not in t0:
                raise CheckpointError(f"checkpoint: tensor '{prefix}mlp.router.weight' is missing")
            self.router = t0["mlp.router.weight"].float()
            self.router_bias = _opt_float(t0.get("mlp.router.bias"))
            self.score_bias = _opt_float(t0.get("mlp.router.e_score_correction_bias"))
            if args.moe_scoring == "sigmoid" and self.score_bias is None:
                raise CheckpointError(f"checkpoint: tensor '{prefix}mlp.router.e_score_correction_bias' is missing")
            self.mlp = nn.ModuleList(MoEShard(t, prefix, args, r) for r, t in zip(tp_ranks, rank_tensors))
            if args.shared_experts:
                self.shared = nn.ModuleList(GatedMLPShard(t, prefix, own, r, "mlp.shared_expert") for r, t in owned)
        else:
            name = "ffn" if args.dense_layers else "mlp"  # a dense layer of a model with MoE layers after it
            self.mlp = nn.ModuleList(GatedMLPShard(t, prefix, own, r, name) for r, t in owned)
        self.proj_bias = None if self.is_moe else _opt_float(t0.get("mlp.proj.bias"))  # experts add theirs

    @classmethod
    def from_unsharded(cls, args: ModelArgs, tensors: dict, layer_idx: int = 0) -> "DecoderLayer":
        """Build from one layer's UNSHARDED TRT-LLM tensors (full names or relative to the layer)."""
        prefix = f"transformer.layers.{layer_idx}."
        rel = {k[len(prefix) :] if k.startswith(prefix) else k: t for k, t in tensors.items()}
        return cls(args.unsharded(), [rel], layer_idx)

    def named_linears(self):
        """(TRT-LLM module name, module) of every linear on every rank, e.g. for calibration hooks."""
        prefix = f"transformer.layers.{self.layer_idx}."
        for r, (attn, mlp) in enumerate(zip(self.attention, self.mlp)):
            yield from ((f"{prefix}attention.{n}", r, getattr(attn, n)) for n in ("qkv", "dense"))
            if self.is_moe:
                yield from ((f"{prefix}mlp.fc", r, m) for m in mlp.fc)
                yield from ((f"{prefix}mlp.proj", r, m) for m in mlp.proj)
            else:
                yield from ((f"{prefix}mlp.{n}", r, getattr(mlp, n)) for n in ("fc", "gate", "proj"))

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int | torch.Tensor = 0,
        cache: Optional[KVCache | BatchKVCache] = None,
        cos_sin: Optional[tuple] = None,
    ) -> torch.Tensor:
        """x: [B, T, H] float32 hidden states at positions start_pos..start_pos+T-1 -> [B, T, H].

        ``start_pos`` is one int for every row, or a LongTensor [B] of per-row starts (batched decoding,
        with a :class:`BatchKVCache`).
        """
        if isinstance(cos_sin, dict):  # every rope's tables (rope_tables): take this layer's
            cos_sin = cos_sin[self.rope_key]
        elif cos_sin is not None and self.rope_key != "global":
            raise ValueError(
                f"layer {self.layer_idx} uses the {self.rope_key} rope: pass rope_tables(...), not one table"
            )
        cos, sin = cos_sin if cos_sin is not None else self.rope.cos_sin_for(start_pos, x.shape[1])
        cos, sin = cos.to(x.device), sin.to(x.device)
        h = rms_norm(x, self.input_ln, self.eps)
        attn = self.all_reduce(
            sum(s(h, cos, sin, start_pos, cache, (self.layer_idx, r)) for r, s in enumerate(self.attention))
        )
        attn = _add_bias(attn, self.dense_bias)  # the all-reduce of the row-parallel dense
        if self.inter_layernorms:
            x = x + rms_norm(attn, self.post_ln, self.eps)
            h = rms_norm(x, self.pre_ff_ln, self.eps)
        else:
            x = x + attn
            h = rms_norm(x, self.post_ln, self.eps)
        if self.is_moe and self.attention_dp:  # the routed experts over every rank's tokens, the shared ones here
            flat = h.reshape(-1, h.shape[-1])
            mlp = self.moe_exchange(flat, self._routed)
            if self.shared is not None:
                mlp = mlp + self.shared[0](flat)
            mlp = mlp.view_as(h)
        elif self.is_moe:
            flat = h.reshape(-1, h.shape[-1])
            weights = self._weights(flat)
            if self.shared is None:
                partial = sum(s(flat, weights) for s in self.mlp)
            else:  # each rank adds its shard of the shared experts to its experts' partial: one all-reduce
                partial = sum(s(flat, weights) + sh(flat) for s, sh in zip(self.mlp, self.shared))
            mlp = self.all_reduce(partial).view_as(h)
        else:
            mlp = self.all_reduce(sum(s(h) for s in self.mlp))
        mlp = _add_bias(mlp, self.proj_bias)
        if self.inter_layernorms:
            mlp = rms_norm(mlp, self.post_ff_ln, self.eps)
        return x + mlp

    def _weights(self, flat: torch.Tensor) -> torch.Tensor:
        """Routing weights [N, E] of tokens [N, H] (0 for the experts a token does not go to)."""
        a = self.routing
        if a.moe_scoring == "sigmoid":
            return group_limited_route(
                flat,
                self.router,
                self.score_bias,
                self.top_k,
                a.moe_groups,
                a.moe_topk_groups,
                self.renormalize,
                a.routed_scaling_factor,
            )
        return route(flat, self.router, self.top_k, self.renormalize, self.router_bias)

    def _routed(self, flat: torch.Tensor) -> torch.Tensor:
        """This process's routed experts over tokens [N, H] (routed here: the router is on every rank)."""
        weights = self._weights(flat)
        return sum(s(flat, weights) for s in self.mlp)

    def idle(self, hidden: int) -> None:
        """An attention-DP rank without tokens this step still serves its experts to the others' tokens."""
        if self.is_moe and self.attention_dp:
            self.moe_exchange(torch.zeros(0, hidden), self._routed)


def _identity(x):
    return x


def _run_here(tokens: torch.Tensor, experts) -> torch.Tensor:
    return experts(tokens)


def _opt_float(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


def _add_bias(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x if bias is None else x + bias


class ReferenceModel(nn.Module):
    """Embedding -> decoder layers of every PP rank in order -> ln_f -> lm_head (tp shards concatenated).

    ``config`` is the checkpoint's config.json dict; ``forward`` returns float32 logits [B, T, V] (V unpadded).
    """

    def __init__(
        self,
        config: dict,
        args: ModelArgs,
        embedding: torch.Tensor,
        layers: list[DecoderLayer],
        ln_f: torch.Tensor,
        lm_head: list[nn.Module],
    ):
        super().__init__()
        self.config, self.args = config, args
        self.embedding = embedding.float()  # [V, H]
        self.layers = nn.ModuleList(layers)
        self.ln_f = ln_f.float()
        self.lm_head = nn.ModuleList(lm_head)
        self.rope = args.rope()  # the global rope (every layer's, unless the model has sliding layers)
        self.ropes = args.ropes()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(input_ids, self.embedding)
        return x if self.args.embed_scale == 1.0 else x * self.args.embed_scale

    def head(self, h: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([m(rms_norm(h, self.ln_f, self.args.norm_epsilon)) for m in self.lm_head], dim=-1)
        return softcap(logits[..., : self.args.vocab_size], self.args.final_logit_softcapping)  # drop lm_head's padding

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, cache: Optional[KVCache | BatchKVCache] = None, start_pos: int | torch.Tensor = 0
    ) -> torch.Tensor:
        """input_ids: [B, T] at positions start_pos..; with a cache, keys/values of earlier calls are reused.

        ``start_pos``: one int for all rows, or a LongTensor [B] of per-row starts with a :class:`BatchKVCache`.
        """
        x = self.embed(input_ids)  # [B, T, H]
        cos_sin = rope_tables(self.ropes, start_pos, input_ids.shape[1])
        for layer in self.layers:
            x = layer(x, start_pos, cache, cos_sin)
        logits = self.head(x)
        return logits if logits.dtype == torch.float64 else logits.float()  # float64: a float64 oracle copy
