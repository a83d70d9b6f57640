"""Lookahead decoding in a recipe: its (W, N, G) configuration, the draft length an engine is built with, and the
rules that check it per target.

Upstream's names and numbers:

- ``executor::LookaheadDecodingConfig(windowSize, ngramSize, verificationSetSize)``, defaults 4 / 3 / 4
  (``kDefaultLookaheadDecodingWindow`` / ``Ngram`` / ``VerificationSet``), ``isLE`` ("``this`` can be executed on
  resources defined by ``that``") and ``isLegal`` (``cpp/include/tensorrt_llm/executor/executor.h@0165bd7a``,
  ``cpp/tensorrt_llm/executor/decodingConfig.cpp@0371ba0f``); ``calculateSpeculativeResourceTuple``: max draft
  tokens ``(N - 2 if N > 1 else 0) + (W - 1 + G) * (N - 1)``, decoding tokens one more, path length N, accepted
  drafts at most N - 1.
- The LLM API's ``LookaheadDecodingConfig`` (``decoding_type: Lookahead``, ``max_window_size``, ``max_ngram_size``,
  ``max_verification_set_size``) answers ``supports_backend``: ``backend not in ("pytorch", "_autodeploy")``
  (``tensorrt_llm/llmapi/llm_args.py``; the index does not record that revision's commit): TensorRT-LLM's PyTorch
  backend, which trtpipe's ``llmapi`` target is, does not run lookahead decoding. The engine target does:
  ``trtllm-build --speculative_decoding_mode lookahead_decoding --max_draft_len D``
  (``tensorrt_llm/commands/build.py@65f1d153``), D this configuration's max draft tokens (the decoding layer checks
  ``maxTokensPerStep == decodingTokens``: ``cpp/tensorrt_llm/layers/lookaheadDecodingLayer.cpp@05cc2c11``).
- The Triton ``tensorrt_llm`` model takes ``decoding_mode: lookahead`` (one of the modes tensorrtllm_backend's
  ``docs/model_config.md@0b9d7d5a`` lists) and the executor's ``lookahead_window_size``,
  ``lookahead_ngram_size``, ``lookahead_verification_set_size`` parameters, and per request the same three inputs,
  all three or none, refused when the model has no lookahead parameters
  (``triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/1/model.py@0d5352f5``
  ``get_executor_lookahead_config`` / ``get_lookahead_decoding_config_from_request``); a request's sizes may not
  exceed the executor's (``LookaheadAlgorithm::setup``: "lookahead requires setup w <= max_w",
  ``cpp/tensorrt_llm/layers/lookaheadAlgorithm.cpp@22d95135``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from trtpipe.recipe.rules import Finding
from trtpipe.recipe.schema import Recipe

KEY = "speculative"
ENGINE_MODE = "lookahead_decoding"  # trtllm-build --speculative_decoding_mode
LLMAPI_TYPE = "Lookahead"  # the LLM API's decoding_type (not on the PyTorch backend)
DEFAULT_WINDOW, DEFAULT_NGRAM, DEFAULT_VERIFICATION_SET = 4, 3, 4  # executor.h@0165bd7a
TRITON_DECODING_MODE = "lookahead"  # the tensorrt_llm model's decoding_mode
TRITON_PARAMETERS = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")


@dataclass(frozen=True)
class LookaheadConfig:
    """(W, N, G): ``executor::LookaheadDecodingConfig(windowSize, ngramSize, verificationSetSize)``."""

    window_size: int
    ngram_size: int
    verification_set_size: int

    def problems(self) -> list[str]:
        """Why upstream's constructor would refuse it (``LookaheadDecodingConfig::isLegal``); [] when legal."""
        w, n, g = self.window_size, self.ngram_size, self.verification_set_size
        out = []
        if n < 1:
            out.append("ngram size must be >= 1")
        if w < 1:
            out.append("window size must be >= 1")
        if g < 0:
            out.append("verification set size must be >= 0")
        if n == 1 and w != 1:
            out.append("ngram size 1 requires window size 1")
        if n == 1 and g != 0:
            out.append("ngram size 1 requires verification set size 0")
        return out

    def resource(self) -> tuple[int, int, int, int]:
        """``calculateSpeculativeResourceTuple``: (max decoding tokens, max path length, max draft tokens, max draft
        path length)."""
        w, n, g = self.window_size, self.ngram_size, self.verification_set_size
        draft = (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)
        return draft + 1, n, draft, n - 1

    @property
    def max_draft_len(self) -> int:
        """What ``trtllm-build --max_draft_len`` must be for an engine serving this configuration."""
        return self.resource()[2]

    def fits_in(self, other: "LookaheadConfig") -> bool:
        """``isLE``: every size at most ``other``'s (a request's configuration against the executor's)."""
        return (
            self.window_size <= other.window_size
            and self.ngram_size <= other.ngram_size
            and self.verification_set_size <= other.verification_set_size
        )

    def __str__(self) -> str:
        return f"(w {self.window_size}, n {self.ngram_size}, g {self.verification_set_size})"

    def executor_fields(self) -> dict[str, int]:
        """The ExecutorConfig fields of this configuration (the sizes and the draft length)."""
        return {**self.as_parameters(), "max_draft_len": self.max_draft_len}

    def as_parameters(self) -> dict[str, int]:
        """The Triton ``tensorrt_llm`` parameters (or request inputs) of this configuration."""
        return dict(zip(TRITON_PARAMETERS, (self.window_size, self.ngram_size, self.verification_set_size)))


def recipe_config(recipe: Recipe) -> Optional[LookaheadConfig]:
    """The executor's (max) lookahead configuration of an engine-target recipe, or None."""
    s = recipe.speculative
    if s.decoding_type != ENGINE_MODE:
        return None
    return LookaheadConfig(s.max_window_size, s.max_ngram_size, s.max_verification_set_size)


def draft_len(recipe: Recipe) -> int:
    """Draft tokens per step the engine is built and scheduled for: lookahead's from (W, N, G), EAGLE-3's dynamic
    tree's max_total_draft_tokens (its max_draft_len is the depth, as upstream), else max_draft_len."""
    cfg, s = recipe_config(recipe), recipe.speculative
    if cfg is not None:
        return cfg.max_draft_len
    if s.decoding_type == "Eagle3" and s.use_dynamic_tree and s.max_total_draft_tokens:
        return s.max_total_draft_tokens
    return s.max_draft_len


def lookahead_findings(recipe: Recipe) -> Iterable[Finding]:
    s = recipe.speculative
    if s.decoding_type == LLMAPI_TYPE:
        if recipe.target == "llmapi":
            yield (
                f"{KEY}.decoding_type",
                "Lookahead is not supported by TensorRT-LLM's PyTorch backend (LookaheadDecodingConfig."
                "supports_backend: not pytorch), which target llmapi serves; use target: engine with decoding_type: "
                "lookahead_decoding",
            )
        else:
            yield (
                f"{KEY}.decoding_type",
                "Lookahead is the LLM API's spelling; target engine takes trtllm-build's: decoding_type: "
                "lookahead_decoding",
            )
        return
    cfg = recipe_config(recipe)
    if cfg is None:
        return
    for problem in cfg.problems():
        yield f"{KEY}.max_ngram_size", f"lookahead {cfg}: {problem} (executor::LookaheadDecodingConfig)"
    if "max_draft_len" in s.model_fields_set and s.max_draft_len != cfg.max_draft_len:
        yield (
            f"{KEY}.max_draft_len",
            f"lookahead {cfg} drafts {cfg.max_draft_len} tokens per step ((N - 2) + (W - 1 + G) * (N - 1)), and the "
            f"engine must be built with exactly that; remove max_draft_len or set it to {cfg.max_draft_len}",
        )


def triton_parameters(recipe: Recipe) -> dict[str, object]:
    """The ``tensorrt_llm`` model's decoding parameters for lookahead ({} without it): ``decoding_mode: lookahead``
    and the executor's ``lookahead_*`` sizes (``get_decoding_config`` / ``get_executor_lookahead_config``,
    model.py@0d5352f5)."""
    cfg = recipe_config(recipe)
    if cfg is None or recipe.target != "engine":
        return {}
    return {"decoding_mode": TRITON_DECODING_MODE, **cfg.as_parameters()}
