"""Metric formulas, statistics and goodput, checked against hand-computed values (exact arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

from trtpipe.errors import TrtpipeError
from trtpipe.bench.metrics import METRICS, BenchError, Request, parse_slo, request_values, samples, stats, summarize

MS = 1_000_000  # ns


def req(start_ms, times_ms, osl, isl=10, error=None):
    return Request(int(start_ms * MS), [int(t * MS) for t in times_ms], osl=osl, isl=isl, error=error)


def test_per_request_formulas():
    # sent at 0; responses at 100, 110, 130 ms; 5 tokens (one response carried three of them)
    v = request_values(req(0, [100, 110, 130], osl=5))
    assert v["ttft"] == 100.0 and v["e2e"] == 130.0 and v["decode"] == 30.0
    assert v["ttst"] == 10.0
    assert v["itl"] == v["tpot"] == 30.0 / 4  # (e2e - ttft) / (osl - 1): per token, not per response
    assert v["user_tps"] == pytest.approx(1000.0 / 7.5, rel=1e-15)
    one = request_values(req(0, [50], osl=1))
    assert one["itl"] is None and one["ttst"] is None and one["ttft"] == one["e2e"] == 50.0


def test_stats_are_numpy_linear_percentiles():
    vals = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    s = stats(vals)
    assert s["p50"] == 3.5 and s["min"] == 1.0 and s["max"] == 9.0 and s["n"] == 8
    assert s["p90"] == pytest.approx(6.0 + 0.3 * 3.0, rel=1e-15)  # rank 6.3 between 6 and 9
    assert s["avg"] == 31.0 / 8
    assert stats([None, None]) is None


def test_run_level_throughput_and_goodput():
    reqs = [
        req(0, [100, 200], osl=11),
        req(50, [120, 250], osl=11),
        req(100, [400, 1000], osl=21),
        req(10, [], osl=None, error="HTTP 500"),
    ]
    s = summarize(reqs, parse_slo("ttft:150ms,itl:15ms"))
    duration_s = 1.0  # first send 0 ms, last response 1000 ms
    assert s["request_throughput"]["value"] == 3 / duration_s
    assert s["output_token_throughput"]["value"] == 43 / duration_s
    assert s["total_token_throughput"]["value"] == 73 / duration_s
    # ttft 100/70/300 ms, itl 10/13/30 ms: only the first two meet both bounds
    assert s["goodput"]["value"] == 2 / duration_s
    assert s["good_request_fraction"]["value"] == 2 / 4  # the failed request counts in the denominator
    assert s["_run"] == {"requests": 4, "ok": 3, "failed": 1, "duration_s": 1.0}
    assert s["chunk_gap"]["n"] == 3 and s["chunk_gap"]["max"] == 600.0
    for name, entry in s.items():
        if name != "_run":
            assert entry["formula"] == METRICS[name].formula


def test_samples_keep_each_request_value():
    reqs = [req(0, [10, 20], osl=3), req(0, [30, 60], osl=4)]
    smp = samples(reqs)
    assert smp["ttft"] == [10.0, 30.0] and smp["itl"] == [5.0, 10.0] and "tpot" not in smp


@pytest.mark.parametrize(
    "text,expected",
    [
        ("ttft:200ms,itl:50ms", {"ttft": 200.0, "itl": 50.0}),
        ("e2e:1.5s", {"e2e": 1500.0}),
        ("ttft=250", {"ttft": 250.0}),
    ],
)
def test_parse_slo(text, expected):
    assert parse_slo(text) == expected


@pytest.mark.parametrize("text", ["ttft", "latency:5ms", "ttft:fast"])
def test_bad_slo_names_the_part(text):
    with pytest.raises(TrtpipeError, match=f"--slo: cannot read '{text}'"):
        parse_slo(text)


def test_bench_slo_refuses_a_percentile_target():
    # goodput counts requests; a run percentile is plan --slo's term, named with the per-request spelling to use
    with pytest.raises(TrtpipeError, match=r"'ttft_p99=200ms' is a percentile target.*ttft:200ms"):
        parse_slo("ttft_p99=200ms")


def test_no_successful_request_is_an_error():
    with pytest.raises(BenchError, match="no request succeeded"):
        summarize([req(0, [], osl=None, error="boom")])


def test_stats_by_hand():
    # linear interpolation between closest ranks (AIPerf's and numpy's default): the p-th percentile of n sorted
    # values sits at rank (n - 1) * p / 100; here n = 5, so p25 is rank 1 (20), p1 rank 0.04 (10 + 0.04 * 10)
    s = stats([50.0, 10.0, None, 40.0, 20.0, 30.0])  # unsorted, and a request without the value
    assert s["n"] == 5 and s["avg"] == 30.0 and s["min"] == 10.0 and s["max"] == 50.0
    assert s["std"] == pytest.approx(200.0**0.5, rel=1e-12)  # population std: sqrt(mean of (20, 10, 0, 10, 20)^2)
    want = {1: 10.4, 5: 12.0, 10: 14.0, 25: 20.0, 50: 30.0, 75: 40.0, 90: 46.0, 95: 48.0, 99: 49.6}
    assert {p: s[f"p{p}"] for p in want} == pytest.approx(want, rel=1e-12)
    assert stats([7.0])["p1"] == stats([7.0])["p99"] == 7.0
    assert stats([]) is None and stats([None]) is None


def _closest_ranks(values, p):
    """The same definition written out another way: sort, then interpolate between the two ranks around
    (n - 1) * p / 100 with exact fractions (no numpy)."""
    from fractions import Fraction

    v = sorted(Fraction(x) for x in values)
    rank = Fraction(len(v) - 1) * Fraction(p, 100)
    lo = int(rank)
    hi = min(lo + 1, len(v) - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (rank - lo))


def test_percentiles_agree_with_closest_ranks_on_random_data():
    rng = np.random.default_rng(1)
    vals = rng.exponential(50.0, size=257).tolist()
    s = stats(vals)
    for p in (1, 5, 10, 25, 50, 75, 90, 95, 99):
        assert s[f"p{p}"] == pytest.approx(_closest_ranks(vals, p), rel=1e-12, abs=0), p
