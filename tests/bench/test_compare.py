"""``bench compare``: gate parsing, bootstrap intervals, and the CLI's exit code on real result files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from trtpipe.bench.compare import bootstrap_delta, compare, parse_gate
from trtpipe.bench.metrics import BenchError, Request, samples, summarize
from trtpipe.bench.run import FORMAT
from trtpipe.cli import main

MS = 1_000_000


def result(ttfts_ms, itl_ms=5.0, osl=9, label="c4"):
    """A result document built the way run_point builds one (summarize + samples of real Request records)."""
    reqs = [Request(0, [int(t * MS), int((t + itl_ms * (osl - 1)) * MS)], osl=osl) for t in ttfts_ms]
    m = summarize(reqs)
    run = m.pop("_run")
    return {
        "format": FORMAT,
        "label": label,
        "created": "now",
        "run": run,
        "metrics": m,
        "samples": samples(reqs),
        "load": {"concurrency": 4, "isl": 16, "osl": osl},
        "provenance": {},
    }


def test_parse_gate():
    g = parse_gate("ttft.p99>+10%")
    assert (g.metric, g.stat, g.op, g.pct) == ("ttft", "p99", ">", 10.0)
    g = parse_gate("output_token_throughput<-5%")
    assert (g.metric, g.stat, g.op, g.pct) == ("output_token_throughput", "value", "<", -5.0)
    assert parse_gate("e2e>3%").stat == "p50"
    for bad in ("ttft.p99>10", "latency.p50>+1%", "request_throughput.p50<-1%", "ttft.median>+1%"):
        with pytest.raises(BenchError, match="--fail-if"):
            parse_gate(bad)


def test_bootstrap_interval_covers_no_change_for_the_same_distribution_and_not_for_a_shift():
    rng = np.random.default_rng(0)
    a = rng.lognormal(4.0, 0.3, size=200)
    b = rng.lognormal(4.0, 0.3, size=200)
    point, low, high = bootstrap_delta(a, b, "p50", seed=1)
    assert low < 0 < high and low < point < high
    point, low, high = bootstrap_delta(a, a * 1.3, "p99", seed=1)
    assert point == pytest.approx(30.0, rel=1e-9) and low > 0
    point, low, high = bootstrap_delta(a, a, "avg")
    assert point == 0.0


def test_gate_needs_a_large_and_significant_change():
    rng = np.random.default_rng(2)
    base = rng.lognormal(4.0, 0.2, size=120)
    same = result(rng.permutation(base))
    slow = result(base * 1.25)
    a = result(base)
    gates = [parse_gate("ttft.p99>+10%"), parse_gate("request_throughput<-10%")]
    assert not compare(a, same, gates)["failed"]
    verdict = compare(a, slow, gates)
    assert verdict["failed"] and verdict["gates"][0]["failed"]
    assert "95% CI" in verdict["gates"][0]["detail"]


def test_cli_exit_codes(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.lognormal(4.0, 0.2, size=80)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "result.json").write_text(json.dumps(result(base)))
    (tmp_path / "b.json").write_text(json.dumps(result(base * 1.5)))
    ok = CliRunner().invoke(
        main,
        ["bench", "compare", str(tmp_path / "a"), str(tmp_path / "a" / "result.json"), "--fail-if", "ttft.p99>+10%"],
    )
    assert ok.exit_code == 0, ok.output
    assert "pass ttft.p99>+10%: change +0.0%" in ok.output
    bad = CliRunner().invoke(
        main,
        [
            "bench",
            "compare",
            str(tmp_path / "a"),
            str(tmp_path / "b.json"),
            "--fail-if",
            "ttft.p99>+10%",
            "--fail-if",
            "itl.avg>+10%",
        ],
    )
    assert bad.exit_code == 1, bad.output
    assert "FAIL ttft.p99>+10%: change +50.0%" in bad.output and "pass itl.avg>+10%" in bad.output
    (tmp_path / "c.json").write_text("{}")
    res = CliRunner().invoke(main, ["bench", "compare", str(tmp_path / "a"), str(tmp_path / "c.json")])
    assert res.exit_code == 1 and "not a trtpipe bench result" in res.output


@pytest.mark.slow
def test_repeated_runs_put_run_to_run_drift_into_the_interval():
    rng = np.random.default_rng(4)
    base = rng.lognormal(4.0, 0.1, size=100)
    # the same build measured three times on a machine whose load drifts by +-25% between runs
    runs_a = [result(base * f) for f in (1.0, 1.25, 0.8)]
    runs_b = [result(rng.permutation(base) * f) for f in (1.2, 0.85, 1.0)]
    gate = [parse_gate("ttft.p50>+10%")]
    # one run each: the drift looks like a significant +20% change
    assert compare(runs_a[0], runs_b[0], gate)["failed"]
    # three runs each: the interval spans the drift, so the same build passes
    assert not compare(runs_a, runs_b, gate)["failed"]
    # a real slowdown of 2x still fails through the same drift
    slow = [result(base * f * 2.0) for f in (1.1, 0.9, 1.0)]
    res = compare(runs_a, slow, gate + [parse_gate("request_throughput<-10%")])
    assert res["failed"] and all(v["failed"] for v in res["gates"][:1])
    assert res["a"]["runs"] == 3 and res["rows"][-1]["ci_pct"] is not None
