"""The unified-HF (ModelOpt) format of each scheme the llmapi target writes: config keys, tensor names, dtypes.

What TensorRT-LLM's PyTorch backend loads (``_torch/modules/linear.py``) is what ModelOpt 0.47.0's
``export_hf_checkpoint`` writes; per HF linear ``P`` (e.g. ``model.layers.{i}.self_attn.q_proj``):

==========================  ==============  =====================  ============  ==============  ===============
quant_algo                  P.weight        P.weight_scale         P.input_scale P.weight_scale_2 P.pre_quant_scale
==========================  ==============  =====================  ============  ==============  ===============
FP8                         F8_E4M3         F32 [] own amax/448    F32 []        -               -
FP8_PER_CHANNEL_PER_TOKEN   F8_E4M3         F32 [out]              -             -               -
W8A16                       I8              F32 [out]              -             -               -
W4A16_AWQ                   U8 [out/2, in]  F32 [out, in/g]        -             -               o/down only
W4A8_AWQ                    U8 [out/2, in]  F32 [out, in/g]        F32 []        F32 []          o/down only
NVFP4                       U8 [out, in/2]  F8_E4M3 [out, in/16]   F32 []        F32 []          -
==========================  ==============  =====================  ============  ==============  ===============

The pre-quant scale of q/k/v and of gate/up is folded into the RMSNorm before them (its weight times the
scale); o_proj and down_proj keep it as a tensor in the model dtype, and so does every projection of a MoE expert
(the norm before the experts is shared by all of them; ModelOpt writes the experts' mean scale into each). FP8 weight scales are per projection
(q, k, v each their own amax) while the input scale is the group's; W4A8's ``input_scale`` and
``weight_scale_2`` are shared by q/k/v and by gate/up (the loader asserts they are equal); a MoE expert has its
own (its gate/up pair shares them; the fused MoE loader takes their max, trtpipe.export.rules).
KV cache (``kv_cache_quant_algo: FP8``): ``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale``, F32 [] =
amax/448, not clamped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trtpipe.formats.schemes import BY_RECIPE, FP8_TENSOR, KV_BY_RECIPE, Scheme, written_for

# trtpipe's quantizer names (TRT-LLM checkpoint) -> the unified HF suffix
SUFFIX = {
    "weights_scaling_factor": "weight_scale",
    "activation_scaling_factor": "input_scale",
    "weights_scaling_factor_2": "weight_scale_2",
    "prequant_scaling_factor": "pre_quant_scale",
}
# HF suffixes ModelOpt stores as 0-d scalars
SCALARS = ("input_scale", "weight_scale_2", "k_scale", "v_scale")
# recipe algos whose FP8 weight scales are per projection (q, k, v each their own amax), not the fused group's
OWN_WEIGHT_SCALE = ("fp8",)


@dataclass(frozen=True)
class HFFormat:
    """One unified-HF format: the scheme table's row as this writer reads it.

    Attributes:
        quant_algo: ``quantization.quant_algo`` of hf_quant_config.json (and the inline config).
        base: the trtpipe algorithm (``trtpipe.checkpoint.quant_layouts.ALGOS``) whose scales are written;
            None = computed here (schemes the TRT-LLM checkpoint writer does not write).
        group_keys: hf_quant_config.json carries ``group_size``, ``has_zero_point``, ``pre_quant_scale``.
        own_weight_scale: per-tensor weight scales per projection (FP8), not the fused group's.
        config_groups: the inline ``config_groups`` ModelOpt writes for this algo (None: none).
        group_size: a fixed block size written as ``group_size``, instead of the recipe's.
    """

    quant_algo: str
    base: Optional[str]
    group_keys: bool = False
    own_weight_scale: bool = False
    config_groups: Optional[dict] = None
    group_size: Optional[int] = None

    @classmethod
    def of(cls, s: Scheme) -> "HFFormat":
        return cls(
            s.quant_algo,
            s.recipe if "engine" in s.targets else None,
            s.groupwise,
            s.recipe in OWN_WEIGHT_SCALE,
            s.hf_config_groups,
            s.block,
        )


# the scheme table's rows the llmapi target writes
HF_FORMATS: dict[str, HFFormat] = {a: HFFormat.of(BY_RECIPE[a]) for a in written_for("llmapi")}
# algos whose unified HF layout trtpipe writes for stacked MoE experts (each expert an nn.Linear of its own)
# (the scheme table's moe column, in its advice order)
MOE_EXPORT_ALGOS = ("none", *sorted(written_for("llmapi", moe=True), key=lambda a: BY_RECIPE[a].advise or 0))
HF_KV = {name: k.kv_cache_quant_algo for name, k in KV_BY_RECIPE.items()}
KV_SCHEME = {"FP8": FP8_TENSOR}


def hf_quant_config(algo: str, kv_cache: str, group_size: int, exclude_modules: list[str], producer: dict) -> dict:
    """hf_quant_config.json: the nested form every TRT-LLM release reads (key order as ModelOpt writes it)."""
    f = HF_FORMATS.get(algo)
    q: dict = {
        "quant_algo": f.quant_algo if f else None,
        "kv_cache_quant_algo": HF_KV[kv_cache] if kv_cache != "none" else None,
    }
    if f is not None and f.group_keys:
        q.update(group_size=group_size, has_zero_point=False, pre_quant_scale=True)
    elif f is not None and f.group_size:
        q["group_size"] = f.group_size
    q["exclude_modules"] = list(exclude_modules)
    return {"producer": dict(producer), "quantization": q}


def inline_quantization_config(hf_quant: dict) -> dict:
    """config.json ``quantization_config``: the flat form ModelOpt 0.47.0 writes beside hf_quant_config.json.

    No ``group_size`` here (ModelOpt does not copy it; hf_quant_config.json, which wins, carries it).
    """
    q = hf_quant["quantization"]
    out: dict = {}
    f = next((f for f in HF_FORMATS.values() if f.quant_algo == q["quant_algo"]), None)
    if f is not None and f.config_groups is not None:
        out["config_groups"] = f.config_groups
    out["ignore"] = list(q["exclude_modules"])
    kv = q.get("kv_cache_quant_algo")
    if kv is not None:
        out["kv_cache_scheme"] = KV_SCHEME.get(kv, kv)
    out.update(producer=dict(hf_quant["producer"]), quant_algo=q["quant_algo"], quant_method="modelopt")
    return out
