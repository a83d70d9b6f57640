"""``trtpipe predict RECIPE`` and ``trtpipe plan RECIPE --slo`` on llmapi (PyTorch-backend) recipes: they are predicted
with the constants fitted on the PyTorch backend's published rows (not the engine era's), MoE recipes carry their
expert parallelism into the cost model, and the nearest published rows quoted are the PyTorch backend's own. Small
workloads (ISL 256 / OSL 32) keep the simulations to seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtpipe.cli import main
from trtpipe.errors import TrtpipeError
from trtpipe.app import predictor as P
from trtpipe.perf.fit import load_constants, predict_rows
from trtpipe.perf.published import PUBLISHED_CSV, read_rows

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
STORIES = RECIPES / "stories-llmapi-fp8.yaml"  # target: llmapi, shipped
SMALL_POOL = ["engine.kv_cache.max_tokens=65536"]  # a 260k-parameter model would get a 237M-token pool on an H100
LLAMA70B = RECIPES / "llama70b-fp8.yaml"  # the published Llama 3.1 70B config, deployed on the PyTorch backend
MIXTRAL = RECIPES / "mixtral-8x7b-fp8.yaml"
AS_LLMAPI = ["--set", "target=llmapi"]
WORKLOAD = ["--isl", "256", "--osl", "32"]
GPU = "h100-sxm-80gb"


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_predict_llmapi_recipe_uses_the_pytorch_constants():
    res = cli("predict", str(STORIES), "--set", SMALL_POOL[0], *WORKLOAD, "--gpu", GPU, "--concurrency", "4", "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    setup = P.recipe_setup(STORIES, SMALL_POOL, gpu=GPU)
    assert setup.family == "pytorch" and "(PyTorch backend)" in setup.label
    fitted = load_constants()
    want = P.summary(setup, P.simulate(setup, fitted["pytorch"], 256, 32, concurrency=4))
    assert {k: got[k] for k in want} == want
    # the engine era's constants give another answer: the family choice is visible in the numbers
    other = P.summary(setup, P.simulate(setup, fitted["engine"], 256, 32, concurrency=4))
    assert other["itl_ms"] != want["itl_ms"]


def test_predict_moe_recipe_with_expert_parallelism():
    ov = AS_LLMAPI  # the shipped recipe: tp2 with moe_ep 2
    res = cli("predict", str(MIXTRAL), *ov, *WORKLOAD, "--gpu", GPU, "--concurrency", "8")
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0].startswith(f"2x {GPU} tp2 pp1 ep2 fp8 (PyTorch backend)")
    ep = P.recipe_setup(MIXTRAL, ["target=llmapi"], gpu=GPU).deployment
    tp = P.recipe_setup(MIXTRAL, ["target=llmapi", "parallel.moe_ep=1", "parallel.moe_tp=2"], gpu=GPU).deployment
    assert (ep.ep, tp.ep) == (2, 1)
    # same bytes per GPU either way (4 whole experts, or half of all 8), but one routed token reads whole experts
    # on its rank under EP and slices of two experts under MoE-TP
    assert ep.weight_bytes_per_gpu == pytest.approx(tp.weight_bytes_per_gpu)


def test_predict_quotes_the_pytorch_backends_own_published_rows():
    res = cli(
        "predict",
        str(LLAMA70B),
        *AS_LLMAPI,
        "--set",
        "parallel.tp=2",
        "--set",
        "engine.workers=2",
        *WORKLOAD,
        "--gpu",
        GPU,
        "--concurrency",
        "2",
        "--published",
        str(PUBLISHED_CSV),
        "--json",
    )
    assert res.exit_code == 0, res.output
    near = json.loads(res.output)["nearest_published"]
    assert near, "Llama 3.x 70B FP8 on H100 has published PyTorch-backend rows"
    assert all(r["backend"].startswith("pytorch:") for r in near[:3]), near
    assert all(r["predicted"] is not None for r in near if r["concurrency_or_batch"] == "max-load")


def test_plan_slo_on_an_llmapi_recipe_answers_the_fewest_replicas_that_meet_it():
    slo, rate = "ttft_p99=5ms,itl_p99=2ms", 400.0
    res = cli(
        "plan",
        str(STORIES),
        "--set",
        SMALL_POOL[0],
        "--slo",
        slo,
        "--rate",
        str(rate),
        "--isl",
        "64",
        "--osl",
        "8",
        "--gpus",
        GPU,
    )
    assert res.exit_code == 0, res.output
    targets = P.parse_slo(slo)
    rows = [o for o in P.capacity_plan(STORIES, targets, rate, 64, 8, SMALL_POOL, [GPU]) if o.get("fits")]
    assert rows and all("(PyTorch backend)" in o["layout"] for o in rows)
    printed = re.findall(r"^\s+(MEETS|misses)\s+(\d+) GPUs =\s+(\d+) x \[(.+?)\]", res.output, re.M)
    assert printed == [
        ("MEETS" if o["meets_slo"] else "misses", str(o["total_gpus"]), str(o["replicas"]), o["layout"]) for o in rows
    ]
    c = load_constants()["pytorch"]
    for o in rows:
        tp = int(re.search(r" tp(\d+) ", o["layout"]).group(1))
        setup = P.recipe_setup(STORIES, SMALL_POOL, gpu=GPU, tp=tp)
        at = lambda n: P.meets(P.simulate(setup, c, 64, 8, rate=rate / n, num_requests=200), targets)[0]  # noqa: E731
        if o["meets_slo"]:
            assert at(o["replicas"]), o["layout"]
            fewer = [n for n in P.REPLICAS if n < o["replicas"]]
            if fewer:
                assert not at(fewer[-1]), o["layout"]


GPT_OSS = RECIPES / "gpt-oss-120b-mxfp4.yaml"  # shipped: tp4, moe_ep 4, MXFP4 experts as OpenAI ships them
QWEN3_30B = RECIPES / "qwen3-30b-a3b-fp8.yaml"  # shipped: one H100; published only in FP4 on Blackwell


@pytest.mark.slow
def test_predict_gpt_oss_recipe_beside_its_published_rows():
    res = cli("predict", str(GPT_OSS), *WORKLOAD, "--concurrency", "4", "--published", str(PUBLISHED_CSV), "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    setup = P.recipe_setup(GPT_OSS, [])
    d = setup.deployment
    assert (d.tp, d.ep, d.model.mxfp4_experts) == (4, 4, True) and setup.family == "pytorch"
    # algo none keeps the experts as shipped: the layout says MXFP4, not a bare "bf16" (which would read 234 GB)
    assert got["layout"] == "4x h100-sxm-80gb tp4 pp1 ep4 mxfp4-experts+bf16 (PyTorch backend)"
    want = P.summary(setup, P.simulate(setup, load_constants()["pytorch"], 256, 32, concurrency=4))
    assert {k: got[k] for k in want} == want
    near = got["nearest_published"]
    assert near and all(r["model"] == "GPT-OSS 120B" and r["gpu"] == "H100 SXM 80GB" for r in near), near
    # the quoted predictions are the fitted model's for those rows' own published configuration
    rows = [r for r in read_rows(PUBLISHED_CSV) if r["model"] == "GPT-OSS 120B" and r["gpu"] == "H100 SXM 80GB"]
    by_row = {
        (r["trtllm_version"], r["isl"], r["osl"], r["backend"]): p
        for r, p in zip(rows, predict_rows(rows, load_constants()))
    }
    for r in near:
        assert r["predicted"] == by_row[(r["trtllm_version"], r["isl"], r["osl"], r["backend"])]


@pytest.mark.slow
def test_predict_says_when_no_published_row_is_on_that_gpu():
    res = cli("predict", str(QWEN3_30B), *WORKLOAD, "--concurrency", "2", "--published", str(PUBLISHED_CSV))
    assert res.exit_code == 0, res.output
    assert f"nearest published numbers: none for this model on {GPU}" in res.output
    res = cli(
        "predict",
        str(QWEN3_30B),
        "--set",
        "quantization.algo=nvfp4",
        "--gpu",
        "b200-180gb",
        *WORKLOAD,
        "--concurrency",
        "2",
        "--published",
        str(PUBLISHED_CSV),
        "--json",
    )
    assert res.exit_code == 0, res.output
    near = json.loads(res.output)["nearest_published"]
    assert near and all(r["model"] == "Qwen3-30B-A3B" and r["gpu"] == "B200 180GB" for r in near)


@pytest.mark.parametrize("tp, want_ep", [(1, 1), (2, 2), (4, 4), (8, 8)])
def test_plan_layouts_keep_the_recipes_expert_split_on_fewer_or_more_gpus(tp, want_ep):
    """gpt-oss-120b's recipe keeps each expert whole (moe_ep 4 = tp 4, moe_tp 1): plan --slo's layouts with another
    tp spread the whole experts over all their GPUs, instead of carrying moe_ep 4 into a layout it cannot fit
    (which refused the one- and two-GPU layouts)."""
    setup = P.recipe_setup(RECIPES / "gpt-oss-120b-mxfp4.yaml", gpu="b200-180gb", tp=tp)
    assert (setup.deployment.tp, setup.deployment.ep) == (tp, want_ep)


@pytest.mark.slow
def test_plan_says_whole_why_a_layout_does_not_fit():
    """A layout plan --slo skips carries its refusal whole, the advice ("turn a knob: parallel.tp: 4") included:
    it was cut at 200 characters, mid-word, so the one line that tells the user what to change read "turn a knob: par"."""
    qwen235 = RECIPES / "qwen3-235b-a22b-fp8.yaml"
    res = cli(
        "plan", str(qwen235), "--slo", "ttft_p99=5000ms", "--rate", "1", "--isl", "64", "--osl", "8", "--gpus", GPU
    )
    assert res.exit_code == 0, res.output
    for tp in (1, 2):
        with pytest.raises(TrtpipeError) as exc:
            P.recipe_setup(qwen235, gpu=GPU, tp=tp)
        why = str(exc.value)
        assert "turn a knob: parallel.tp: 4" in why and len(why) > 200
        assert f"    because: {why}\n" in res.output
