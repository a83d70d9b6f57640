"""``plan --slo`` reads the one SLO syntax (trtpipe.slo): percentile targets, per-request bounds, both separators."""

from __future__ import annotations

import numpy as np
import pytest

from trtpipe.errors import TrtpipeError
from trtpipe.app.predictor import meets, parse_slo
from trtpipe.perf.simulate import SimResult


@pytest.mark.parametrize(
    "text,expected",
    [
        ("ttft_p99=500ms,itl_p99=50ms", {"ttft_p99": 500.0, "itl_p99": 50.0}),  # README / docs/perf-model.md
        ("ttft:200ms,itl:50ms", {"ttft": 200.0, "itl": 50.0}),  # the bench spelling
        ("e2e_p90:1.5s", {"e2e_p90": 1500.0}),
    ],
)
def test_plan_reads_both_spellings(text, expected):
    assert parse_slo(text) == expected


@pytest.mark.parametrize(
    "text,names", [("tpot_p99=5ms", "'tpot_p99=5ms'"), ("ttft_p0=5ms", "'ttft_p0=5ms'"), ("", "empty")]
)
def test_plan_bad_term_is_one_line_naming_it(text, names):
    with pytest.raises(TrtpipeError) as info:
        parse_slo(text)
    assert names in str(info.value) and "\n" not in str(info.value)


def sim(ttft_s):
    a = np.asarray(ttft_s, dtype=np.float64)
    return SimResult(ttft=a, itl=a / 10, e2e=a * 2, output_tokens=1, makespan_s=1.0, steps=1, mean_batch=1.0)


def test_meets_percentile_and_every_request():
    res = sim([0.1] * 99 + [1.0])  # one slow request: p50 is 100 ms, the maximum 1 s
    ok, head = meets(res, parse_slo("ttft_p50=200ms"))
    assert ok and head["ttft_p50"] == pytest.approx(2.0)
    ok, head = meets(res, parse_slo("ttft:200ms"))  # a bare metric bounds every request: the 1 s one misses
    assert not ok and head["ttft"] == pytest.approx(0.2)
