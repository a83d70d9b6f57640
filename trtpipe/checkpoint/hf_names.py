"""Where each TensorRT-LLM checkpoint tensor comes from in the Hugging Face checkpoint: the family's conversion
rules inverted (data, not branches). The unified-HF and compressed-tensors exporters write HF tensors with it, the
reference runtime loads HF checkpoints with it, so both read the same names the converter wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from trtpipe.checkpoint.convert import interleaved, transposed
from trtpipe.models import get_family
from trtpipe.models.dims import read_hf_config
from trtpipe.models.family import Rule, shape_symbols

# combine op of a fused-experts rule -> its inverse (TRT-LLM tensor -> the HF tensor), and the ops whose source is
# kept as shipped (MXFP4 blocks and scales: copied, never re-encoded)
FUSED_INVERSE = {"gate_up_t": lambda t: transposed(interleaved(t)), "transposed": transposed}
SHIPPED = ("mxfp4", "mxfp4_gate_up")
CHECKPOINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class HFNames:
    """TRT-LLM tensor name -> HF names and row splits, inverted from the family's conversion rules (data, not
    branches): a ``cat`` rule (q;k;v) splits on dim 0 by its sources' sizes, a rule's ``offset`` (Gemma's +1 norms)
    is subtracted, and names carry the checkpoint's ``weight_prefix`` (``language_model.`` of a multimodal model)."""

    def __init__(self, hf_dir: Path):
        self.info = read_hf_config(hf_dir)
        family = get_family(self.info.architecture)
        self.embedding_excluded = family.embedding_in_exclude_modules
        d = shape_symbols(self.info)
        top = self.info.weight_prefix
        self.prefix = top + family.hf_layer_prefix
        self.layer: dict[str, list[tuple[str, int]]] = {}
        self.globals: dict[str, str] = {}
        self.experts: set[str] = set()  # stacked-expert tensors ([E, ...]): their HF names hold ``{e}``
        self.offsets: dict[str, float] = {}  # TRT-LLM name (relative for layer tensors) -> the rule's offset
        # fused experts in one tensor (gpt-oss): relative TRT-LLM name -> its rule; exported in the source's layout
        self.fused: dict[str, Rule] = {}
        self.hf_dir = Path(hf_dir)
        self.layer_kind: dict[str, str] = {}  # relative TRT-LLM name -> "all", "dense" or "moe" (Rule.layers)
        for r in family.layer_rules:
            if r.when(self.info):
                self.layer[r.trt] = [(h, d[s[0]]) for h, s in zip(r.hf, r.shapes)]
                self.layer_kind[r.trt] = r.layers
                self.offsets[r.trt] = r.offset
                if "experts" in r.combine:
                    self.experts.add(r.trt)
                if r.combine in FUSED_INVERSE or r.combine in SHIPPED:
                    self.fused[r.trt] = r
        for r in family.global_rules:
            if r.when(self.info) and not (r.trt == "lm_head.weight" and self.info.tie_word_embeddings):
                self.globals[r.trt] = top + r.hf[0]
                self.offsets[r.trt] = r.offset

    def in_layer(self, trt_rel: str, layer: int) -> bool:
        """A decoder layer holds this tensor (DeepSeek-V3's dense first layers hold no experts, the others no dense
        MLP)."""
        kind = self.layer_kind.get(trt_rel, "all")
        return kind == "all" or self.info.is_moe_layer(layer) == (kind == "moe")

    def to_hf(self, trt: str, t: torch.Tensor, hf_name: Optional[str] = None) -> torch.Tensor:
        """A TRT-LLM tensor's values as HF stores them (float32 minus the rule's offset where it has one).

        An offset tensor (Gemma's ``w`` stored as ``1 + w``) lost ``w``'s low bits in the cast of ``1 + w`` to the
        model dtype; when ``hf_name`` is given and the checkpoint's tensor is still exactly what the conversion made
        of the source's (no pre-quant scale folded into it), the source's own ``w`` is returned instead."""
        offset = self.offsets.get(trt, 0.0)
        if not offset:
            return t
        if hf_name is not None:
            from trtpipe.checkpoint.hf import open_hf

            with open_hf(self.hf_dir, check_finite=False) as reader:
                src = reader.get(hf_name).clone() if hf_name in reader else None
            # the checkpoint's dtype is gone by here (tensors arrive upcast): exact in any of the model dtypes
            made = (
                src is not None
                and src.shape == t.shape
                and any(torch.equal((src.float() + offset).to(d).float(), t.float()) for d in CHECKPOINT_DTYPES)
            )
            if made:
                return src.float()
        return t.float() - offset

    def from_hf(self, trt: str, t: torch.Tensor) -> torch.Tensor:
        """An HF tensor's values as the TRT-LLM checkpoint holds them (plus the rule's offset), in float32."""
        return t.float() + self.offsets.get(trt, 0.0)

    @property
    def shipped_quantization(self) -> Optional[dict]:
        """The source's ``quantization_config`` when its experts are kept as shipped (gpt-oss MXFP4), else None."""
        if any(r.combine in SHIPPED for r in self.fused.values()):
            return dict(self.info.raw["quantization_config"])
        return None

    def fused_to_hf(self, trt_rel: str, t: torch.Tensor, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """HF tensors of fused experts: a bf16 source's layout restored from the TRT-LLM tensor (gate/up
        re-interleaved, in -> out), or an MXFP4 source's ``*_blocks`` / ``*_scales`` copied byte for byte."""
        from trtpipe.checkpoint.hf import open_hf

        rule, pre = self.fused[trt_rel], self.prefix.format(layer)
        if rule.combine in SHIPPED:
            with open_hf(self.hf_dir, check_finite=False) as reader:
                return {pre + h: reader.get(pre + h).clone() for h in rule.hf}
        return {pre + rule.hf[0]: FUSED_INVERSE[rule.combine](t).to(dtype)}

    def split(self, trt_rel: str, t: torch.Tensor, layer: int) -> list[tuple[str, torch.Tensor]]:
        """(full HF name, tensor) of each source of a layer tensor; ``t``'s dim 0 split by the sources' rows (its
        values as HF stores them: :meth:`to_hf`).

        A stacked-expert tensor ``[E, rows, in]`` gives each expert's sources in expert order (``{e}`` filled in),
        each expert's rows split the same way (``mlp.fc = [up; gate]`` -> ``experts.{e}.up_proj``, ``gate_proj``).
        """
        parts = self.layer[trt_rel]
        raw, t = t, self.to_hf(trt_rel, t)
        pre = self.prefix.format(layer)
        if trt_rel in self.experts:
            sizes = [n for _, n in parts]
            return [
                (pre + h.format(e=e), piece)
                for e in range(t.shape[0])
                for (h, _), piece in zip(parts, t[e].split(sizes, dim=0))
            ]
        if len(parts) == 1:
            return [(pre + parts[0][0], self.to_hf(trt_rel, raw, pre + parts[0][0]))]
        return [(pre + h, piece) for (h, _), piece in zip(parts, t.split([n for _, n in parts], dim=0))]
