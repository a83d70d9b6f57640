"""The twin's step-cost fit (trtpipe/perf/step_fit.py) on synthetic records with a known answer.

Known constants make the steps' times; the fit must give them back, exactly without noise and within a bound
derived from the noise with it. The bound: with one design row per coefficient (six step compositions whose
features are linearly independent), each repeated, any weighted least squares puts the fitted time of each
composition at a weighted mean of that composition's measured times; with multiplicative noise |e| <= delta those
lie within delta * t_d of the true time t_d, so |c_fit - c|_j <= sum_d |X^-1|_jd * delta * t_d, whatever weights
Huber's loop chose.
"""

from __future__ import annotations

import numpy as np
import pytest

from trtpipe.perf.step_fit import (
    ByConcurrency,
    StepCost,
    StepFit,
    batch_features,
    compare_rounds,
    fit_steps,
    host_gaps,
    record_features,
    return_gaps,
    robust_fit,
    step_features,
    worst_ratio_error,
)
from trtpipe.serving.api import StepBatch, StepEntry

# seconds per term: base, generating request, context token, context request, context query-key pair,
# gathered generation key (each contributes milliseconds to some composition below)
TRUE = np.array([2e-3, 100e-6, 10e-6, 200e-6, 30e-9, 0.5e-6])
# (start, tokens, is context) entries of six steps with linearly independent features
COMPOSITIONS = [
    [(0, 1, False)],  # one generating request at position 0
    [(10, 1, False)] * 16,  # 16 generating, short
    [(400, 1, False)] * 16,  # 16 generating, long: the gathered-key term
    [(0, 256, True)],  # one long prompt: the query-key term
    [(0, 32, True)],  # one short prompt
    [(0, 4, True)] * 8,  # eight tiny prompts: the per-context-request term
]


def records(compositions, coef, copies, rng=None, delta=0.0, start_ns=0, gap_ns=50_000):
    """Iteration records as the twin writes them: consecutive iterations, each timestamped at its end, a fixed host
    gap between steps, times from ``coef`` times (1 + e) with e uniform in [-delta, delta]."""
    out, t = [], start_ns
    for k in range(copies):
        for entries in compositions:
            ms = float(np.dot(step_features(entries), coef)) * 1e3
            if delta:
                ms *= 1.0 + rng.uniform(-delta, delta)
            t += gap_ns + int(round(ms * 1e6))
            out.append(
                {
                    "iter": len(out),
                    "iterLatencyMS": ms,
                    "timestamp": t,
                    "numActiveRequests": len(entries),
                    "scheduledEntries": [list(e) for e in entries],
                }
            )
    return out


def test_features_by_hand():
    # a context chunk of 8 tokens after 32 cached ones, one of 4 from scratch, generating rows at 40 and 7
    f = step_features([(32, 8, True), (0, 4, True), (40, 1, False), (7, 1, False)])
    assert f == [1.0, 2.0, 12.0, 2.0, 8 * 40 + 4 * 4, 2 * 41]
    assert step_features([]) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    batch = StepBatch(
        3, [StepEntry(0, list(range(8)), 32, [0, 1], True, True), StepEntry(1, [5], 40, [2], False, True)]
    )
    assert batch_features(batch) == step_features([(32, 8, True), (40, 1, False)])
    assert record_features({"scheduledEntries": [[32, 8, True], [40, 1, False]]}) == batch_features(batch)


def test_fit_recovers_the_constants_without_noise():
    rng = np.random.default_rng(0)
    # random realistic steps: up to 16 generating rows anywhere below 512, up to 3 prompt chunks
    comps = []
    for _ in range(300):
        gen = [(int(rng.integers(0, 500)), 1, False) for _ in range(int(rng.integers(0, 17)))]
        ctx = [(int(rng.integers(0, 64)), int(rng.integers(1, 200)), True) for _ in range(int(rng.integers(0, 4)))]
        comps.append(gen + ctx)
    fit = fit_steps(records(comps, TRUE, 1))
    np.testing.assert_allclose(fit.coef, TRUE, rtol=1e-6)
    np.testing.assert_allclose(fit.ratios, 1.0, rtol=1e-6)


def test_fit_is_within_the_noise_bound():
    delta = 0.01
    x = np.array([step_features(c) for c in COMPOSITIONS])
    bound = np.abs(np.linalg.inv(x)) @ (delta * (x @ TRUE))
    assert (bound < TRUE).all()  # the bound says something about every term
    for seed in range(5):
        fit = fit_steps(records(COMPOSITIONS, TRUE, 40, np.random.default_rng(seed), delta))
        err = np.abs(fit.coef - TRUE)
        assert (err <= bound * (1 + 1e-9)).all(), (seed, err / bound)
        assert np.all(np.abs(fit.ratios - 1) <= 3 * delta)


def test_stalls_barely_move_the_fit():
    """Huber weights: 5 % of steps stalled to 10x move the fit far less than they move plain least squares."""
    rng = np.random.default_rng(3)
    recs = records(COMPOSITIONS, TRUE, 40, rng, 0.01)
    for r in recs[::20]:
        r["iterLatencyMS"] *= 10.0
    x = np.array([record_features(r) for r in recs])
    y = np.array([r["iterLatencyMS"] / 1e3 for r in recs])
    plain = np.linalg.lstsq(x, y, rcond=None)[0]
    robust = robust_fit(x, y)
    rel = lambda c: np.max(np.abs(c - TRUE) / TRUE)  # noqa: E731
    assert rel(plain) > 0.3  # the stalls do matter to plain least squares
    assert rel(robust) < 0.2 * rel(plain)


def test_a_negative_term_is_dropped_and_the_rest_refitted():
    x = np.array([step_features(c) for c in COMPOSITIONS] * 3)
    truth = TRUE.copy()
    truth[5] = 0.0
    y = x @ truth - 1e-8 * x[:, 5]  # exactly what a negative gathered-key cost would give
    assert np.linalg.lstsq(x, y, rcond=None)[0][5] < 0
    coef = robust_fit(x, y)
    assert coef[5] == 0.0 and (coef >= 0).all()
    np.testing.assert_allclose(coef[:5], robust_fit(x[:, :5], y), rtol=1e-9)


def test_host_gaps_by_hand():
    recs = [
        {"iter": 0, "timestamp": 10_000_000, "iterLatencyMS": 2.0, "numActiveRequests": 1},
        {"iter": 1, "timestamp": 13_000_000, "iterLatencyMS": 2.5, "numActiveRequests": 1},  # 0.5 ms gap
        {"iter": 3, "timestamp": 30_000_000, "iterLatencyMS": 1.0, "numActiveRequests": 1},  # not consecutive
        {"iter": 4, "timestamp": 31_000_000, "iterLatencyMS": 1.2, "numActiveRequests": 0},  # -0.2 ms -> 0
        {"iter": 5, "timestamp": 40_000_000, "iterLatencyMS": 1.0, "numActiveRequests": 1},
    ]  # after idle: out
    np.testing.assert_allclose(host_gaps(recs), [0.5e-3, 0.0], atol=1e-12)


def test_fit_steps_skips_idle_loop_turns_and_refuses_none():
    recs = records(COMPOSITIONS, TRUE, 2)
    idle = [{**r, "iterLatencyMS": 0.0} for r in recs[:3]]
    np.testing.assert_allclose(fit_steps(recs + idle).coef, fit_steps(recs).coef, rtol=1e-12)
    with pytest.raises(ValueError, match="no busy step"):
        fit_steps(idle)


def test_step_cost_draws_are_seeded_and_centred_on_the_fit():
    fit = StepFit(TRUE, np.array([0.5, 1.0, 1.5]), np.array([1e-4]))
    batch = StepBatch(0, [StepEntry(0, [1], 10, [0], False, True)])
    typical = float(np.dot(batch_features(batch), TRUE))
    a, b = StepCost(fit, seed=4), StepCost(fit, seed=4)
    draws = [a(batch)[0] for _ in range(50)]
    assert draws == [b(batch)[0] for _ in range(50)]
    assert {round((d - 1e-4) / typical, 9) for d in draws} == {0.5, 1.0, 1.5}
    assert StepCost(StepFit(TRUE, np.ones(1), np.zeros(0)))(batch) == (pytest.approx(typical, rel=1e-12), "cpu")


def test_return_gaps_by_hand():
    # concurrency 2: the k-th final frees the (2 + k)-th arrival; finals at 100 and 100 ns are one step's
    arrivals = [0, 0, 150, 160, 400]
    finals = [100, 100, 300, 500, 600]
    g = return_gaps(arrivals, finals, 2)
    np.testing.assert_allclose(g.returns, [50e-9, 60e-9, 100e-9])
    median = 60e-9
    # steps: 100 ns freed two (median 55 ns), 300 ns freed one
    np.testing.assert_allclose(sorted(g.group), sorted([55e-9 / median, 100e-9 / median]))
    np.testing.assert_allclose(g.jitter, [-5e-9 / median, 5e-9 / median])
    with pytest.raises(ValueError, match="no request followed another"):
        return_gaps([0, 1], [5, 6], 2)


def test_by_concurrency_interpolates_medians_by_hand():
    t = ByConcurrency.from_points([(2, [1.0, 2.0, 3.0]), (2, [3.0, 4.0, 5.0]), (8, [10.0, 10.0, 40.0])])
    assert t.concurrencies == [2, 8] and t.medians == [3.0, 10.0]  # median of (2, 4); median of (10)
    assert t.median_at(4) == pytest.approx(3.0 + 7.0 * 2 / 6)
    assert t.median_at(1) == 3.0 and t.median_at(16) == 10.0  # held flat outside
    np.testing.assert_allclose(sorted(t.spread), sorted([0.5, 1, 1.5, 0.75, 1, 1.25, 1, 1, 4]))
    assert set(t.draw(8, 20, np.random.default_rng(0)) / 10.0) <= set(t.spread)


def test_compare_rounds_by_hand():
    rounds = [
        {1: ({"x": 10.0}, {"x": 12.0}), 2: ({"x": 1.0}, {"x": 1.0})},
        {1: ({"x": 20.0}, {"x": 18.0})},
        {1: ({"x": 30.0}, {"x": 33.0})},
    ]
    (row,) = compare_rounds(rounds, ["x"])  # concurrency 2 is missing from two rounds
    assert row.concurrency == 1
    assert row.measured == {"x": 20.0} and row.simulated == {"x": 18.0}
    assert row.ratio["x"] == pytest.approx(1.1)  # median of 1.2, 0.9, 1.1: not simulated median / measured median
    assert worst_ratio_error([row]) == pytest.approx(0.1)
