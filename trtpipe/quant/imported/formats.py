"""What a pre-quantized checkpoint is, in one record, and what each target does with it.

Every importer parses its format into an :class:`ImportedFormat`: the canonical ModelOpt ``quant_algo`` its
projections are re-laid out into (the unified HF per-projection tensors ``weight``, ``weight_scale``,
``input_scale``, ``weight_scale_2``, ``pre_quant_scale``), the numbers that describe it, and per target an
:class:`Action`. Nothing downstream branches on the format family: the engine converter and the runtime read
the canonical tensors, the recipe rules read the actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Action kinds, as the format x target table in docs/reference/prequantized.md names them.
CONVERTED = "converted"  # into the TensorRT-LLM checkpoint layout, as upstream's converter would
PASSED = "passed through"  # copied as is (the target loads it)
RELAID = "re-laid out"  # exact re-layout into a format the target loads (no new rounding)
REFUSED = "refused"


@dataclass(frozen=True)
class Action:
    kind: str
    why: str = ""  # the refusal text (reason and the alternative), or what a re-layout produces

    @property
    def ok(self) -> bool:
        return self.kind != REFUSED


@dataclass(frozen=True)
class ImportedFormat:
    """A recognised pre-quantized checkpoint.

    Attributes:
        family: ``modelopt``, ``compressed-tensors``, ``awq``, ``gptq``, ``fbgemm_fp8``, ``fp8_block``, ``mxfp4``.
        name: the format as its producer names it (``FP8``, ``W4A16 pack-quantized``, ``gptq v1``...).
        quant_algo: the canonical ModelOpt algorithm the projections are re-laid out into (None: KV-cache only or
            no canonical form).
        bits / group_size: weight bits; group size (None = per tensor / per channel).
        granularity: ``per-tensor``, ``per-channel``, ``group``, ``block``.
        exclude: HF module names / patterns left unquantized (as the source writes them).
        kv_cache: ``FP8`` when the checkpoint carries KV-cache scales, else None.
        engine / llmapi: what each target does with it.
        config: the file and key the format was read from (for messages).
        params: format-specific settings the importer's re-layout needs (zero points, packing, ...).
    """

    family: str
    name: str
    quant_algo: Optional[str]
    bits: Optional[int]
    group_size: Optional[int]
    granularity: str
    exclude: tuple[str, ...]
    kv_cache: Optional[str]
    engine: Action
    llmapi: Action
    config: str
    params: dict = field(default_factory=dict)

    def action(self, target: str) -> Action:
        return self.engine if target == "engine" else self.llmapi

    def describe(self) -> str:
        """One line: format, bits, group size, kv cache, what is excluded."""
        bits = f"{self.bits}-bit weights" if self.bits else "unquantized weights"
        gran = f"group size {self.group_size}" if self.group_size else self.granularity
        kv = f"kv cache {self.kv_cache}" if self.kv_cache else "kv cache unquantized"
        excl = ", ".join(self.exclude) if self.exclude else "nothing"
        return f"{self.family} {self.name} ({bits}, {gran}; {kv}; excluded: {excl}) from {self.config}"
