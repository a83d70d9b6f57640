"""Lookahead decoding executed by the in-flight batching executor on stories260k (trtpipe/serving/lookahead.py over
the masked verification of trtpipe/serving/tree_verify.py): all branches in one target forward per step.

Greedy output with lookahead is the output without it, token for token, and transformers' float64 greedy output
(near-ties judged by float32's own measured error); drafts are accepted (more than one token per target forward on
prompts that repeat); a request's own smaller (W, N, G) runs; sampling and oversize requests are refused in one line;
every KV block comes back."""

from __future__ import annotations

import pytest
import torch

from trtpipe.serving.api import ErrorKind, ExecutorConfig, Request, SamplingParams
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.lookahead import GREEDY_ONLY
from trtpipe.serving.reference_engine import ReferenceEngine

from serving_oracle import check_greedy

EOS = 2
N_OUT = 32


def _config(w=4, n=3, g=4, **kw) -> ExecutorConfig:
    d = (n - 2 if n > 1 else 0) + (w - 1 + g) * (n - 1)
    base = dict(
        max_batch_size=8,
        max_num_tokens=8 * (d + 1),
        max_input_len=96,
        max_seq_len=160,
        num_blocks=128,
        tokens_per_block=8,
    )
    la = dict(
        speculative_decoding_type="Lookahead",
        max_draft_len=d,
        lookahead_window_size=w,
        lookahead_ngram_size=n,
        lookahead_verification_set_size=g,
    )
    return ExecutorConfig(**{**base, **la, **kw})


def _serve(model, config, requests):
    final = {}
    core = ExecutorCore(
        config, ReferenceEngine(model), lambda r: final.__setitem__(r.request_id, r) if r.is_final else None
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids], core


def _prompts(n: int, seed: int, repetitive: bool):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if repetitive:  # a phrase said three times: the pool holds its n-grams from the prompt on
            phrase = torch.randint(3, 500, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            out.append([1] + phrase * 3)
        else:
            out.append(
                [1] + torch.randint(3, 500, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            )
    return out


def _requests(prompts, lookahead=None):
    return [
        Request(p, N_OUT, end_id=EOS, exclude_input_from_output=True, return_perf_metrics=True, lookahead=lookahead)
        for p in prompts
    ]


@pytest.mark.slow
@pytest.mark.parametrize("wng", [(4, 3, 4), (3, 4, 2)])
def test_greedy_identical_with_and_without_lookahead_and_to_transformers(model_tp1, oracle, wng):
    prompts = _prompts(4, seed=5, repetitive=True) + _prompts(4, seed=6, repetitive=False)
    plain_cfg = ExecutorConfig(
        max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=128, tokens_per_block=8
    )
    plain, plain_core = _serve(model_tp1, plain_cfg, _requests(prompts))
    la, core = _serve(model_tp1, _config(*wng), _requests(prompts))
    for p, a, b in zip(prompts, plain, la):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens  # lookahead changes nothing in greedy output
        assert check_greedy(model_tp1, oracle, p, b.tokens, N_OUT, EOS) == ""
    s = core.speculator
    assert 0 < s.total_accepted_draft_tokens <= s.total_draft_tokens
    assert sum(r.perf.total_accepted_draft_tokens for r in la) == s.total_accepted_draft_tokens
    # every verification is one target forward for its request: fewer of them than tokens produced
    produced = sum(len(r.tokens) for r in la)
    assert s.verifications < produced - len(la)
    stats = core.pool.stats()
    assert stats.free_blocks == stats.max_blocks  # every block came back


@pytest.mark.slow
def test_a_requests_own_smaller_configuration(model_tp1, oracle):
    prompts = _prompts(3, seed=7, repetitive=True)
    la, core = _serve(model_tp1, _config(4, 3, 4), _requests(prompts, lookahead=(2, 2, 1)))
    for p, b in zip(prompts, la):
        assert not b.has_error, b.error
        assert check_greedy(model_tp1, oracle, p, b.tokens, N_OUT, EOS) == ""
    # (w 2, n 2, g 1): at most (2 - 1 + 1) * 1 = 2 drafts a step, one accepted
    assert core.speculator.total_draft_tokens <= 2 * core.speculator.verifications
    assert core.speculator.total_accepted_draft_tokens <= core.speculator.verifications


def test_sampling_and_oversize_requests_are_refused_in_one_line(model_tp1):
    sampled = Request([1, 5, 6], 4, sampling=SamplingParams(0.7, 0, 1.0, 3))
    big = Request([1, 5, 6], 4, lookahead=(5, 3, 4))
    out, _ = _serve(model_tp1, _config(4, 3, 4), [sampled, big])
    assert out[0].error.endswith(": " + GREEDY_ONLY) and out[0].error_kind is ErrorKind.INVALID
    assert "request lookahead (w 5, n 3, g 4) exceeds the model's (w 4, n 3, g 4)" in out[1].error
    plain = ExecutorConfig(
        max_batch_size=2, max_num_tokens=64, max_input_len=32, max_seq_len=64, num_blocks=32, tokens_per_block=8
    )
    out, _ = _serve(model_tp1, plain, [Request([1, 5, 6], 4, lookahead=(2, 2, 1))])
    assert "can only be set if the model instance lookahead parameters are also specified" in out[0].error


@pytest.mark.slow
def test_greedy_identical_at_tp2(model_tp2, oracle):
    """The tp=2 checkpoint (two shards per layer, summed as the all-reduce would): the masked step and the accepted
    drafts' KV move on every shard."""
    prompts = _prompts(4, seed=9, repetitive=True)
    plain_cfg = ExecutorConfig(
        max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=128, tokens_per_block=8
    )
    plain, _ = _serve(model_tp2, plain_cfg, _requests(prompts))
    la, core = _serve(model_tp2, _config(4, 3, 4), _requests(prompts))
    for p, a, b in zip(prompts, plain, la):
        assert not b.has_error, b.error
        assert b.tokens == a.tokens
        assert check_greedy(model_tp2, oracle, p, b.tokens, N_OUT, EOS) == ""
    assert core.speculator.total_accepted_draft_tokens > 0
