"""``trtpipe predict RECIPE`` and ``trtpipe plan RECIPE --slo`` at the command line, on the shipped llama70b-fp8 recipe
(its model.source is the published config.json in recipes/configs/): the printed numbers are the library's
simulation of the same recipe, the answers have the properties they claim, and bad input is one line and a
non-zero exit. Small workloads (ISL 256 / OSL 32) keep the simulations to seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.app import predictor as P
from trtpipe.perf.fit import load_constants

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "llama70b-fp8.yaml"
WORKLOAD = ["--isl", "256", "--osl", "32"]
SLO = "ttft_p99=300ms,itl_p99=40ms"  # the syntax README and docs/reference/perf-model.md show for plan --slo
RATE = 12.0
GPU = "h100-sxm-80gb"


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _one_line_error(res, *needles: str) -> None:
    assert res.exit_code != 0, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], lines[0]


def test_predict_prints_the_library_simulation():
    res = cli("predict", str(RECIPE), *WORKLOAD, "--concurrency", "8")
    assert res.exit_code == 0, res.output
    setup = P.recipe_setup(RECIPE)
    s = P.summary(setup, P.simulate(setup, load_constants()["engine"], 256, 32, concurrency=8))
    lines = res.output.splitlines()
    # the recipe's own layout (4x H100 tp4, FP8) and 4 x concurrency requests (fewest 32), as --help says
    assert lines[0].startswith("4x h100-sxm-80gb tp4 pp1 fp8: ISL 256 / OSL 32, concurrency 8, 32 simulated requests")
    assert f"KV pool {setup.kv_tokens} tokens, max_batch_size {setup.max_batch_size}" in lines[0]
    total, per_gpu = (float(x.replace(",", "")) for x in re.findall(r"([\d,]+\.\d) (?:total|per GPU)", lines[1]))
    assert (total, per_gpu) == (s["output_tok_s"], s["output_tok_s_per_gpu"])
    assert per_gpu == pytest.approx(total / 4, abs=0.051)  # per GPU is the total over the recipe's 4 GPUs
    for line, key in ((lines[2], "ttft_ms"), (lines[3], "itl_ms")):
        got = {f"p{q}": float(v) for q, v in re.findall(r"p(\d+)\s+([\d.]+)", line)}
        assert got == s[key], (line, s[key])
        assert got["p50"] <= got["p90"] <= got["p99"]
    assert f"mean batch {s['mean_batch']}" in lines[4] and s["mean_batch"] <= 8  # 8 clients: at most 8 at once
    as_json = json.loads(cli("predict", str(RECIPE), *WORKLOAD, "--concurrency", "8", "--json").output)
    assert {k: as_json[k] for k in s} == s


@pytest.mark.slow
def test_plan_slo_answers_the_fewest_replicas_that_meet_it():
    res = cli("plan", str(RECIPE), "--slo", SLO, "--rate", str(RATE), *WORKLOAD, "--gpus", GPU)
    assert res.exit_code == 0, res.output
    targets = P.parse_slo(SLO)
    rows = P.capacity_plan(RECIPE, targets, RATE, 256, 32, gpus=[GPU])
    printed = [
        m.groups()
        for m in re.finditer(
            r"^\s+(MEETS|misses)\s+(\d+) GPUs =\s+(\d+) x \[(.+?)\]\s+TTFT p99\s+"
            r"([\d.]+) ms\s+ITL p99\s+([\d.]+) ms",
            res.output,
            re.M,
        )
    ]
    fitting = [o for o in rows if o.get("fits")]
    assert printed == [
        (
            "MEETS" if o["meets_slo"] else "misses",
            str(o["total_gpus"]),
            str(o["replicas"]),
            o["layout"],
            f"{o['ttft_ms']['p99']:.1f}",
            f"{o['itl_ms']['p99']:.1f}",
        )
        for o in fitting
    ]
    assert any(o["replicas"] > 1 and o["meets_slo"] for o in fitting), "the workload should need several replicas"
    c = load_constants()["engine"]
    for o in fitting:
        tp = int(re.search(r" tp(\d+) ", o["layout"]).group(1))
        setup = P.recipe_setup(RECIPE, gpu=GPU, tp=tp)
        assert o["total_gpus"] == o["replicas"] * tp
        at = lambda n: P.meets(P.simulate(setup, c, 256, 32, rate=RATE / n, num_requests=200), targets)[0]  # noqa: E731
        if o["meets_slo"]:
            assert at(o["replicas"]), o["layout"]  # the answer meets the SLO ...
            fewer = [n for n in P.REPLICAS if n < o["replicas"]]
            if fewer:
                assert not at(fewer[-1]), o["layout"]  # ... and the next smaller count tried does not
    # fewest GPUs first among those that meet it
    meeting = [o["total_gpus"] for o in fitting if o["meets_slo"]]
    assert meeting == sorted(meeting)


# (a value without a unit is milliseconds in the one SLO syntax, trtpipe/slo.py, as bench --slo always read it)
@pytest.mark.parametrize("slo", ["ttft_p99=fast", "latency_p99=5ms", "ttft_p99=500min"])
def test_plan_bad_slo_is_one_line(slo):
    _one_line_error(cli("plan", str(RECIPE), "--slo", slo, "--rate", "4", *WORKLOAD, "--gpus", GPU), "--slo")


def test_plan_slo_needs_a_rate():
    _one_line_error(cli("plan", str(RECIPE), "--slo", SLO), "--rate")


@pytest.mark.parametrize(
    "command",
    [
        ["predict", str(RECIPE), *WORKLOAD, "--gpu", "no-such-gpu"],
        ["plan", str(RECIPE), "--slo", SLO, "--rate", "4", *WORKLOAD, "--gpus", "no-such-gpu"],
    ],
)
def test_unknown_gpu_is_one_line(command):
    res = cli(*command)
    _one_line_error(res, "no-such-gpu")
