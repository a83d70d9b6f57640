"""Drafts that come with the request (``draft_input_ids``: upstream's two-model draft-target form, where the BLS asks
a draft model and sends its tokens to the target) verified in the context step's forward, on stories260k.

The target's tokens after the prompt are known (greedy decoding without drafts), so each case's acceptance is worked
out by hand: drafts equal to the continuation are all accepted; a draft that differs at position j keeps j - 1 of
them plus the target's own token there. The output is greedy decoding's in every case.
"""

from __future__ import annotations

import pytest

from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine

PROMPT = [1, 403, 407, 261, 378]
N = 8  # new tokens per request


def _config() -> ExecutorConfig:
    return ExecutorConfig(
        max_batch_size=8, max_num_tokens=128, max_input_len=96, max_seq_len=160, num_blocks=96, tokens_per_block=8
    )


def _serve(model, requests):
    final = {}
    core = ExecutorCore(
        _config(), ReferenceEngine(model), lambda r: final.__setitem__(r.request_id, r) if r.is_final else None
    )
    ids = [core.submit(r) for r in requests]
    core.run_until_idle()
    return [final[i] for i in ids], core


@pytest.fixture(scope="module")
def greedy(model_tp1) -> list[int]:
    (out,), _ = _serve(model_tp1, [Request(PROMPT, N, exclude_input_from_output=True)])
    assert len(out.tokens) == N
    return out.tokens


def test_the_continuation_as_drafts_is_all_accepted_in_one_forward(model_tp1, greedy):
    k = 4
    req = Request(PROMPT, k + 1, exclude_input_from_output=True, return_perf_metrics=True, draft_tokens=greedy[:k])
    (out,), core = _serve(model_tp1, [req])
    assert out.tokens == greedy[: k + 1]
    assert (out.perf.total_draft_tokens, out.perf.total_accepted_draft_tokens) == (k, k)
    assert core.iteration == 1  # the prompt and its k drafts in one target forward: k + 1 tokens


@pytest.mark.parametrize("wrong_at", [0, 1, 3])
def test_a_wrong_draft_keeps_the_drafts_before_it_and_the_target_token(model_tp1, greedy, wrong_at):
    k = 4
    drafts = list(greedy[:k])
    drafts[wrong_at] = (drafts[wrong_at] + 1) % 512
    req = Request(PROMPT, N, exclude_input_from_output=True, return_perf_metrics=True, draft_tokens=drafts)
    (out,), core = _serve(model_tp1, [req])
    assert out.tokens == greedy  # greedy decoding's, whatever the drafts
    assert (out.perf.total_draft_tokens, out.perf.total_accepted_draft_tokens) == (k, wrong_at)
    # the verifying forward emits wrong_at + 1 tokens, then one token per step up to N
    assert core.iteration == 1 + N - (wrong_at + 1)


def test_drafts_beside_plain_requests_in_one_batch(model_tp1, greedy):
    reqs = [
        Request(PROMPT, N, exclude_input_from_output=True, return_perf_metrics=True, draft_tokens=greedy[:3]),
        Request(PROMPT, N, exclude_input_from_output=True, return_perf_metrics=True),
        Request(PROMPT[:3], N, exclude_input_from_output=True, return_perf_metrics=True, draft_tokens=[5, 6]),
    ]
    out, _ = _serve(model_tp1, reqs)
    (alone,), _ = _serve(model_tp1, [Request(PROMPT[:3], N, exclude_input_from_output=True)])
    assert out[0].tokens == greedy and out[1].tokens == greedy and out[2].tokens == alone.tokens
    assert out[0].perf.total_accepted_draft_tokens == 3 and out[1].perf.total_draft_tokens == 0
    assert out[2].perf.total_draft_tokens == 2
    assert out[2].perf.total_accepted_draft_tokens == (2 if alone.tokens[:2] == [5, 6] else int(alone.tokens[0] == 5))


def _parse(**inputs):
    from pathlib import Path

    import numpy as np

    from trtpipe.serving.triton_adapter import TwinSettings, parse_request

    arrays = {
        "input_ids": np.array([PROMPT], np.int32),
        "input_lengths": np.array([[len(PROMPT)]], np.int32),
        "request_output_len": np.array([[5]], np.int32),
        **inputs,
    }
    return parse_request(lambda n: arrays.get(n), TwinSettings(Path("."), _config(), False, 2, 1, 512), decoupled=False)


def test_the_twin_reads_draft_input_ids_and_refuses_bad_ones():
    import numpy as np

    assert list(_parse(draft_input_ids=np.array([[7, 8, 9]], np.int32)).request.draft_tokens) == [7, 8, 9]
    assert list(_parse().request.draft_tokens) == []
    with pytest.raises(ValueError, match=r"^draft_input_ids: 5 drafts need request_output_len >= 6, got 5$"):
        _parse(draft_input_ids=np.array([[7, 8, 9, 10, 11]], np.int32))
    with pytest.raises(ValueError, match=r"^draft_input_ids\[1\] = 600 is outside the vocabulary \[0, 512\)$"):
        _parse(draft_input_ids=np.array([[7, 600]], np.int32))
    # draft logits (upstream's use_draft_logits): one row per draft, [1, k, V] as the BLS sends them
    logits = np.arange(2 * 512, dtype=np.float32).reshape(1, 2, 512)
    assert _parse(draft_input_ids=np.array([[7, 8]], np.int32), draft_logits=logits).request.draft_logits.shape == (
        2,
        512,
    )
    with pytest.raises(ValueError, match=r"^draft_logits has shape \(1, 1, 512\): it needs one row of 512 logits per"):
        _parse(draft_input_ids=np.array([[7, 8]], np.int32), draft_logits=np.zeros((1, 1, 512), np.float32))
    assert _parse(return_generation_logits=np.array([[True]])).request.return_generation_logits
