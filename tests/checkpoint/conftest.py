"""Fixtures for conversion tests: tiny HF models (the real stories260k and synthetic ones) and their oracle outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtpipe.models.synthetic import load_hf, make_synthetic
from numerics import assert_as_accurate, assert_greedy_equal, error_scale, hf_float64, suite_threads

# The synthetic models the issue names; llama3 is written sharded (index.json) in the transformers-4 rope layout.
SYNTHETIC = {
    "llama3": dict(shard_bytes=60_000, rope_layout="v4"),
    "qwen2": dict(),
    "qwen3": dict(),
    "qwen3_moe": dict(),
    "mixtral": dict(),
    # sliding_window 5 < the 12-token prompts; greedy's 64 tokens run far past it (layer 5 global, linear rope x8)
    "gemma3": dict(),
    # window 4 < the 12-token prompts on layers 0 and 2; sinks, clamped SwiGLU, biased router, YaRN (truncate false)
    "gpt_oss": dict(),
}


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(suite_threads())


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, stories_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    models = {"stories": stories_dir}
    for kind, kw in SYNTHETIC.items():
        models[kind] = make_synthetic(kind, root / kind, seed=1, **kw)
    return models


@pytest.fixture(scope="session")
def prompts() -> dict[str, list[list[int]]]:
    """A batch of equal-length prompts per model (token ids), plus the stories prompt from SOURCE.md."""
    g = torch.Generator().manual_seed(7)
    synthetic = torch.randint(3, 250, (4, 12), generator=g).tolist()
    stories = [[1, 403, 407, 261, 378], [1, 365, 1, 300, 400], [1, 22, 301, 402, 260], [1, 420, 270, 280, 290]]
    return {"stories": stories, **{k: synthetic for k in SYNTHETIC}}


class Oracle:
    """transformers' logits (float32, and float64 as the reference) and 64-token greedy continuations."""

    def __init__(self, model_dir: Path, prompts: list[list[int]], eos: int | None):
        self.model = load_hf(model_dir)
        self.model64 = hf_float64(self.model)
        ids = torch.tensor(prompts)
        with torch.no_grad():
            self.logits = self.model(ids).logits.float()
            self.logits64 = self.model64(ids).logits
        self.scale = error_scale(self.logits, self.logits64)  # float32's error on these logits
        self.prompts, self.full = prompts, []
        for p in prompts[:2]:
            out = self.model.generate(
                torch.tensor([p]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos if eos is not None else 0,
            )[0, len(p) :].tolist()
            self.full.append(out[: out.index(eos) + 1] if eos is not None and eos in out else out)
        self.eos = eos

    def assert_logits(self, logits: torch.Tensor, what: str) -> None:
        """Our float32 logits are as close to the float64 oracle as transformers' float32 ones (x ORDER_FACTOR)."""
        assert logits.shape == self.logits64.shape
        assert_as_accurate(logits, self.logits64, self.scale, what)

    def assert_greedy(self, ours: list[list[int]], what: str) -> None:
        for p, o, ref in zip(self.prompts, ours, self.full):
            assert_greedy_equal(o, ref, self.model, self.model64, p, what, eos=() if self.eos is None else self.eos)


@pytest.fixture(scope="session")
def oracle(hf_models, prompts):
    cache: dict[str, Oracle] = {}

    def get(name: str) -> Oracle:
        if name not in cache:
            cache[name] = Oracle(hf_models[name], prompts[name], 2 if name == "stories" else None)
        return cache[name]

    return get
