"""One request's failure is its own (issue 38 item 1): sampling values at the edge of what the sampler can compute
(top_p 0, a top_p that rounds to 0, a temperature that overflows the logits) sample as TensorRT-LLM samples them, and
a row whose sampling still fails fails its request alone; every other request in the step is answered as if alone."""

from __future__ import annotations

import pytest
import torch

import trtpipe.serving.reference_engine as reference_engine
from trtpipe.runtime.generate import sample
from trtpipe.serving.api import ExecutorConfig, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

PROMPTS = [[1, 403, 407, 261, 378], [1, 365, 122, 266], [1, 403, 407], [1, 87, 289, 412, 19, 30], [1, 13], [1, 9]]
POISON = [SamplingParams(1.0, 0, 0.0), SamplingParams(1.0, 0, 1e-300), SamplingParams(1e-40, 0, 1.0)]


def _config(**kw) -> ExecutorConfig:
    base = dict(max_batch_size=16, max_num_tokens=256, max_input_len=96, max_seq_len=128, num_blocks=64)
    return ExecutorConfig(**{**base, "tokens_per_block": 8, **kw})


def _run(model, requests: list[Request]) -> dict[int, object]:
    """Every request submitted before the first step (so all share every step), run to the end: final per id."""
    finals = {}
    core = ExecutorCore(_config(), ReferenceEngine(model), lambda r: r.is_final and finals.__setitem__(r.request_id, r))
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [finals[i] for i in ids]


@pytest.mark.parametrize("poison", POISON, ids=["top_p_0", "top_p_1e-300", "temperature_1e-40"])
def test_sampling_at_the_edge_is_greedy_not_nan(poison):
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])  # [V]
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, poison.temperature, poison.top_k, poison.top_p, gen) == 1


@pytest.mark.parametrize("poison", POISON, ids=["top_p_0", "top_p_1e-300", "temperature_1e-40"])
def test_poison_values_beside_six_innocents(model_tp1, poison):
    alone = [_run(model_tp1, [Request(p, 4)])[0].tokens for p in PROMPTS]
    out = _run(model_tp1, [Request(PROMPTS[0], 4, sampling=poison)] + [Request(p, 4) for p in PROMPTS])
    assert [r.error for r in out] == [None] * 7, [r.error for r in out]
    assert [r.tokens for r in out[1:]] == alone
    assert out[0].tokens == alone[0]  # each poison is greedy in effect (top_p 0 by definition)


def test_a_row_that_fails_to_sample_fails_its_request_alone(model_tp1, monkeypatch):
    real = reference_engine.sample

    def fragile(logits, temperature, top_k, top_p, generator):
        if temperature == 0.77:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, temperature, top_k, top_p, generator)

    monkeypatch.setattr(reference_engine, "sample", fragile)
    innocents = [Request(p, 4, sampling=SamplingParams(0.9, 0, 0.9, seed=7)) for p in PROMPTS]
    alone = [_run(model_tp1, [r])[0].tokens for r in innocents]
    out = _run(model_tp1, [Request(PROMPTS[0], 4, sampling=SamplingParams(0.77, 0, 1.0))] + innocents)
    assert out[0].error and "request 1" in out[0].error and "probability tensor" in out[0].error
    assert [r.error for r in out[1:]] == [None] * 6
    assert [r.tokens for r in out[1:]] == alone
