"""The Triton twin's ``return_log_probs`` and ``min_tokens`` (tensorrtllm backend names) through the adapter and the
executor, without a tritonserver: ``output_log_probs`` [1, 1, L] and ``cum_log_probs`` [1, 1] equal transformers'
float64 log-softmax of the output tokens within ``ORDER_FACTOR`` x the float32 error scale; streamed responses carry
their own tokens' log probs, which join to the non-streamed ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from numerics import ORDER_FACTOR, U32, error_scale
from trtpipe.serving.api import ExecutorConfig
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.serving.triton_adapter import TwinSettings, parse_request, response_outputs

PROMPT = [1, 403, 407, 261, 378]


def _settings() -> TwinSettings:
    config = ExecutorConfig(
        max_batch_size=4, max_num_tokens=64, max_input_len=64, max_seq_len=128, num_blocks=32, tokens_per_block=8
    )
    return TwinSettings(Path("."), config, False, 2, 1, 512)


def _run(model, **inputs) -> tuple[list[dict], object]:
    arrays = {
        "input_ids": np.array([PROMPT], np.int32),
        "input_lengths": np.array([[len(PROMPT)]], np.int32),
        "request_output_len": np.array([[10]], np.int32),
        **inputs,
    }
    s = _settings()
    parsed = parse_request(lambda n: arrays.get(n), s, decoupled=True)
    got = []
    core = ExecutorCore(s.executor, ReferenceEngine(model), lambda r: got.append(dict(response_outputs(r, parsed))))
    core.submit(parsed.request)
    core.run_until_idle()
    return got, parsed


@pytest.mark.parametrize("streaming", [False, True])
def test_output_log_probs_equal_float64(model_tp1, oracle, streaming):
    got, _ = _run(
        model_tp1,
        return_log_probs=np.array([[True]]),
        temperature=np.array([[0.9]], np.float32),
        runtime_top_k=np.array([[20]], np.int32),
        seed=np.array([[4]], np.uint64),
        streaming=np.array([[streaming]]),
        exclude_input_in_output=np.array([[True]]),
    )
    tokens = [int(t) for r in got for t in r["output_ids"].reshape(-1)]
    lps = [float(v) for r in got if "output_log_probs" in r for v in r["output_log_probs"].reshape(-1)]
    for r in got:
        assert r["output_log_probs"].shape == (1, 1, r["output_ids"].shape[-1]) and r["cum_log_probs"].shape == (1, 1)
    assert len(lps) == len(tokens) == 10
    seq = PROMPT + tokens
    with torch.no_grad():
        lp64 = torch.log_softmax(oracle(torch.tensor([seq])).logits[0].double(), -1)
        lp32 = torch.log_softmax(model_tp1(torch.tensor([seq]))[0].float(), -1)
    tol = ORDER_FACTOR * error_scale(lp32, lp64, U32)
    want = [float(lp64[len(PROMPT) + j - 1, t]) for j, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(lps, want)) <= tol
    assert float(got[-1]["cum_log_probs"][0, 0]) == pytest.approx(sum(lps), abs=1e-4)


def test_no_log_probs_unless_asked_and_min_tokens_holds_the_end_id(model_tp1):
    got, _ = _run(model_tp1)
    assert "output_log_probs" not in got[-1] and "cum_log_probs" not in got[-1]
    free = got[-1]["output_ids"].reshape(-1).tolist()
    end = free[len(PROMPT) + 1]  # the end id greedy reaches at its second output token
    short, _ = _run(model_tp1, end_id=np.array([[end]], np.int32), exclude_input_in_output=np.array([[True]]))
    assert short[-1]["output_ids"].reshape(-1).tolist() == free[len(PROMPT) : len(PROMPT) + 1]
    held, _ = _run(
        model_tp1,
        end_id=np.array([[end]], np.int32),
        min_tokens=np.array([[5]], np.int32),
        exclude_input_in_output=np.array([[True]]),
    )
    out = held[-1]["output_ids"].reshape(-1).tolist()
    assert len(out) >= 5 and end not in out[:5]
    with pytest.raises(ValueError, match="min_tokens"):
        _run(model_tp1, min_tokens=np.array([[-1]], np.int32))
