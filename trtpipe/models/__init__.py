"""One module per architecture family, each declaring its HF -> TensorRT-LLM mapping as data.

The registry is keyed by ``config.json`` ``architectures[0]``; a new family is a new module plus one
entry in ``FAMILIES``.
"""

from __future__ import annotations

from trtpipe.errors import CheckpointError
from trtpipe.models.dims import ModelDims
from trtpipe.models.family import Family, Rule, num_params as family_num_params
from trtpipe.models.deepseek_v3 import DEEPSEEK_V3
from trtpipe.models.gemma3 import GEMMA3
from trtpipe.models.gpt_oss import GPT_OSS
from trtpipe.models.llama import LLAMA
from trtpipe.models.mixtral import MIXTRAL
from trtpipe.models.qwen2 import QWEN2
from trtpipe.models.qwen3 import QWEN3
from trtpipe.models.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[Family, ...] = (LLAMA, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, GEMMA3, GPT_OSS, DEEPSEEK_V3)

REGISTRY: dict[str, Family] = {arch: fam for fam in FAMILIES for arch in fam.architectures}
PLAIN = Family("plain", (), (), ())  # the behaviour of an architecture no family handles: Llama's


def get_family(architecture: str) -> Family:
    """The family handling an HF architecture; a one-line error listing the supported ones."""
    try:
        return REGISTRY[architecture]
    except KeyError:
        raise CheckpointError(
            f"config.json: architectures[0] '{architecture}' is not supported (supported: {', '.join(sorted(REGISTRY))})"
        ) from None


def num_params(info: ModelDims) -> int:
    """Parameter count of a model from its config (its family's behaviour; Llama's for any other architecture)."""
    return family_num_params(info, REGISTRY.get(info.architecture, PLAIN))


__all__ = ["FAMILIES", "Family", "REGISTRY", "Rule", "get_family", "num_params"]
