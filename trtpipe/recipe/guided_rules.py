"""The recipe's guided-decoding rules: what TensorRT-LLM refuses only at runtime, refused by ``trtpipe validate``.

- ``docs/source/torch/features/feature_combination_matrix.md`` (NVIDIA/TensorRT-LLM@116f6ea9): Guided Decoding x
  MTP = No, x EAGLE-3 (one model engine) = No (x EAGLE-3 two-model = Yes): ``speculative.decoding_type`` and
  ``speculative.eagle3_one_model``.
- ``guided_decoding_backend: llguidance`` is the PyTorch backend's only (LlmArgs: "llguidance is supported in PyTorch
  backend only"); the engine target's ``tensorrtllm`` backend takes ``xgrammar`` (tensorrtllm_backend
  ``docs/guided_decoding.md``@395c4035).
"""

from __future__ import annotations

from typing import Iterable, Optional

from trtpipe.models.dims import ModelDims
from trtpipe.recipe.rules import Finding, Rule
from trtpipe.recipe.schema import Recipe

KEY = "serving.guided_decoding_backend"


def _guided_combinations(recipe: Recipe, m: Optional[ModelDims]) -> Iterable[Finding]:
    backend = recipe.serving.guided_decoding_backend
    if not backend:
        return
    if backend == "llguidance" and recipe.target == "engine":
        yield KEY, "llguidance runs on the PyTorch backend only (target: llmapi); the engine target takes xgrammar"
    spec = recipe.speculative
    kind = spec.decoding_type
    if kind == "MTP":
        yield (
            KEY,
            (
                "guided decoding does not run with speculative.decoding_type MTP (TensorRT-LLM feature-combination "
                "matrix: No); unset serving.guided_decoding_backend or choose another speculative.decoding_type"
            ),
        )
    if kind == "Eagle3" and spec.eagle3_one_model:
        yield (
            KEY,
            (
                "guided decoding does not run with EAGLE-3 one-model (speculative.decoding_type Eagle3, "
                "speculative.eagle3_one_model true; feature-combination matrix: No); set speculative.eagle3_one_model: "
                "false or unset serving.guided_decoding_backend"
            ),
        )


GUIDED_RULES: tuple[Rule, ...] = (_guided_combinations,)
