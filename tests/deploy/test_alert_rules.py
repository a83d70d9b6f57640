"""The rule files of both targets under Debian's promtool: `check rules`, and `test rules` with synthetic series
that make each alert fire (with its labels and summary) and stay silent (below, or at, its threshold).

Expected values are worked out by hand from the series (comments); promtool evaluates the real PromQL.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from deploy_helpers import MULTI_NODE, ONE_NODE, RECIPES

from trtpipe.deploy.alerts import rule_file
from trtpipe.app.validation import load_recipe

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus)")

JOB = "j"
N = "x60"  # 61 samples at 15 s: 15 minutes


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def _case(name, series, alert, eval_time="10m", fires=None):
    return {
        "name": name,
        "interval": "15s",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": fires or []}],
    }


def _alert(severity, summary, recipe, **labels):
    return {"exp_labels": {"recipe": recipe, "severity": severity, **labels}, "exp_annotations": {"summary": summary}}


def _common_cases(recipe: str, server: str, kv: str, ok: str, fail: str, queue, up_fail_labels):
    sel = f'job="{JOB}",instance="i"'
    return [
        # KV: 0.95 > 0.9 for longer than 2 m fires; exactly 0.9 does not (the rule is >)
        _case(
            "kv fires",
            [(kv % sel, "0.95" + N)],
            "KVCacheNearlyFull",
            fires=[_alert("warning", "KV-cache blocks 95% used (over 0.9) (i)", recipe, job=JOB, instance="i")],
        ),
        _case("kv at the threshold", [(kv % sel, "0.9" + N)], "KVCacheNearlyFull"),
        _case("kv inside for", [(kv % sel, "0.5x7 0.95" + N)], "KVCacheNearlyFull", eval_time="3m"),  # high since 1m45s
        # errors: 5 failed per 100 succeeded -> 5/105 > 0.01; none failed -> 0
        _case(
            "errors fire",
            [(ok % sel, "0+100" + N), (fail % sel, "0+5" + N)],
            "RequestErrors",
            fires=[_alert("page", "4.762% of requests fail (over 0.01)", recipe, job=JOB)],
        ),
        _case("no errors", [(ok % sel, "0+100" + N), (fail % sel, "0+0" + N)], "RequestErrors"),
        # queue time twice the compute time fires; half of it does not
        _case(
            "queue dominates",
            queue(2.0, sel),
            "QueueTimeOverComputeTime",
            fires=[
                _alert(
                    "warning", "requests wait longer than they compute (i): add replicas", recipe, job=JOB, instance="i"
                )
            ],
        ),
        _case("compute dominates", queue(0.5, sel), "QueueTimeOverComputeTime"),
        # target down: up == 0, and no up series at all
        _case(
            "target down",
            [(f"up{{{sel}}}", "0" + N)],
            "TargetDown",
            fires=[_alert("page", f"{server} of {recipe} is not scraped (i)", recipe, job=JOB, instance="i")],
        ),
        _case(
            "target absent",
            [('up{job="other",instance="i"}', "1" + N)],
            "TargetDown",
            fires=[_alert("page", f"{server} of {recipe} is not scraped ()", recipe, **up_fail_labels)],
        ),
        _case("target up", [(f"up{{{sel}}}", "1" + N)], "TargetDown"),
    ]


def _histogram(name: str, sel: str, counts: dict[str, int]) -> list[tuple[str, str]]:
    """Cumulative bucket series growing by ``counts[le]`` per 15 s step."""
    return [(f'{name}{{{sel},le="{le}"}}', f"0+{n}{N}") for le, n in counts.items()]


def engine_cases(recipe: str) -> list[dict]:
    ttft = "nv_inference_first_response_histogram_ms_bucket"
    client = f'job="{JOB}",model="ensemble",instance="i"'

    def queue(ratio, sel):
        engine = f'job="{JOB}",model="tensorrt_llm",instance="i"'
        return [
            (f"nv_inference_queue_duration_us{{{engine}}}", f"0+{int(ratio * 1e6)}{N}"),
            (f"nv_inference_compute_infer_duration_us{{{engine}}}", f"0+1000000{N}"),
        ]

    cases = _common_cases(
        recipe,
        "tritonserver",
        'nv_trt_llm_kv_cache_block_metrics{%s,kv_cache_block_type="fraction"}',
        'nv_inference_request_success{%s,model="ensemble"}',
        'nv_inference_request_failure{%s,model="ensemble",reason="BACKEND"}',
        queue,
        {"job": JOB},
    )
    # TTFT: every request in (1000, 5000] ms -> p99 = 1000 + 0.99 * 4000 = 4960 ms = 4.96 s > 2 s
    slow = _histogram(ttft, client, {"1000": 0, "5000": 10, "+Inf": 10})
    fast = _histogram(ttft, client, {"1000": 10, "5000": 10, "+Inf": 10})  # p99 = 990 ms
    cases += [
        _case(
            "ttft fires",
            slow,
            "TTFTAboveSLO",
            fires=[_alert("page", "TTFT p99 4.96s over the SLO 2s (j)", recipe, job=JOB)],
        ),
        _case("ttft within", fast, "TTFTAboveSLO"),
    ]
    return cases


def llmapi_cases(recipe: str) -> list[dict]:
    sel = f'job="{JOB}",model_name="m",engine_type="trtllm",instance="i"'

    def queue(ratio, _):  # per step: queue q s of an end-to-end q + 1 s
        return [
            (f"trtllm_request_queue_time_seconds_sum{{{sel}}}", f"0+{ratio}{N}"),
            (f"trtllm_e2e_request_latency_seconds_sum{{{sel}}}", f"0+{ratio + 1}{N}"),
        ]

    # the label sets of the trtllm series carry model_name and engine_type: the per-target rules keep instance
    cases = [
        c
        for c in _common_cases(
            recipe,
            "trtllm-serve",
            "trtllm_kv_cache_utilization{%s}",
            "trtllm_request_success_total{%s}",
            "trtllm_request_error_total{%s}",
            queue,
            {"job": JOB},
        )
    ]
    for c in cases:  # the twin's label set instead of job/instance only
        for s in c["input_series"]:
            if not s["series"].startswith("up{"):  # Prometheus writes up with the target's labels only
                s["series"] = s["series"].replace(f'job="{JOB}",instance="i"', sel)
    # TTFT all in (2.5, 5] s -> p99 4.975 s; ITL all in (0.1, 0.15] s -> p99 0.1495 s > 0.1 s
    ttft, itl = "trtllm_time_to_first_token_seconds_bucket", "trtllm_time_per_output_token_seconds_bucket"
    cases += [
        _case(
            "ttft fires",
            _histogram(ttft, sel, {"2.5": 0, "5.0": 10, "+Inf": 10}),
            "TTFTAboveSLO",
            fires=[_alert("page", "TTFT p99 4.975s over the SLO 2s (j)", recipe, job=JOB)],
        ),
        _case("ttft within", _histogram(ttft, sel, {"1.0": 10, "5.0": 10, "+Inf": 10}), "TTFTAboveSLO"),
        _case(
            "itl fires",
            _histogram(itl, sel, {"0.1": 0, "0.15": 10, "+Inf": 10}),
            "ITLAboveSLO",
            fires=[_alert("page", "ITL p99 149.5ms over the SLO 0.1s (j)", recipe, job=JOB)],
        ),
        _case("itl within", _histogram(itl, sel, {"0.05": 10, "0.15": 10, "+Inf": 10}), "ITLAboveSLO"),
    ]
    return cases


def llmapi_speculative_cases(recipe: str) -> list[dict]:
    """The llmapi cases plus the acceptance drift alert (deploy.acceptance_drift_alert 0.8, baseline 6 h, for 5 m).

    Drafts grow by 100 per 15 s step for 30 min. Drift: accepted by 80 per step for 20 min, then by 20. At 30 min
    the 5 m rate is 20/100 = 0.2 and the baseline (all 30 min) (80 x 80 + 20 x 40) / (100 x 120) = 0.6; 0.2 < 0.8 x
    0.6 = 0.48, true since the 5 m window is more than 8/15 in the new regime (from 22 min 40 s): over 5 m, fires.
    Steady: 80 of 100 throughout, 0.8 = the baseline: silent. Idle: no drafts, 0/0 = NaN: silent."""
    sel = f'job="{JOB}",model_name="m",engine_type="trtllm",instance="i"'
    drafts, accepted = (
        f"trtllm_spec_decode_draft_tokens_total{{{sel}}}",
        f"trtllm_spec_decode_accepted_tokens_total{{{sel}}}",
    )
    summary = "draft acceptance 20%, under 0.8 x its rate over 6h (j): check the draft and the traffic"
    return llmapi_cases(recipe) + [
        _case(
            "acceptance drifts",
            [(drafts, "0+100x120"), (accepted, "0+80x80 6420+20x39")],
            "SpeculativeAcceptanceDrift",
            eval_time="30m",
            fires=[_alert("warning", summary, recipe, job=JOB)],
        ),
        _case(
            "acceptance steady",
            [(drafts, "0+100x120"), (accepted, "0+80x120")],
            "SpeculativeAcceptanceDrift",
            eval_time="30m",
        ),
        _case("no drafts", [(drafts, "0x120"), (accepted, "0x120")], "SpeculativeAcceptanceDrift", eval_time="30m"),
    ]


@pytest.mark.parametrize(
    "path, overrides, cases",
    [
        (ONE_NODE, [], engine_cases),
        (RECIPES / "stories-llmapi-fp8.yaml", [], llmapi_cases),
        (RECIPES / "stories-llmapi-fp8.yaml", ["speculative.decoding_type=NGram"], llmapi_speculative_cases),
    ],
)
def test_every_alert_fires_and_stays_silent_under_promtool(tmp_path, path, overrides, cases):
    recipe = load_recipe(path, overrides)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(recipe, JOB)))
    check = _promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert check.returncode == 0, check.stdout + check.stderr
    tests = cases(recipe.name)
    alerts = {r["alert"] for g in rule_file(recipe, JOB)["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == {c["alert_rule_test"][0]["alertname"] for c in tests}  # every alert is tested
    for c in tests:  # fire and silent cases for each
        assert any(
            t["alert_rule_test"][0]["exp_alerts"]
            for t in tests
            if t["alert_rule_test"][0]["alertname"] == c["alert_rule_test"][0]["alertname"]
        )
    doc = {"rule_files": ["rules.yaml"], "evaluation_interval": "15s", "tests": tests}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = _promtool("test", "rules", str(tmp_path / "test.yaml"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_broken_expectation_fails_promtool(tmp_path):
    """The harness can fail: a KV alert expected at 0.5 use is reported missing."""
    recipe = load_recipe(ONE_NODE)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(recipe, JOB)))
    wrong = _case(
        "kv",
        [('nv_trt_llm_kv_cache_block_metrics{job="j",instance="i",kv_cache_block_type="fraction"}', "0.5" + N)],
        "KVCacheNearlyFull",
        fires=[_alert("warning", "x", recipe.name, job=JOB)],
    )
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": [wrong]}))
    assert _promtool("test", "rules", str(tmp_path / "test.yaml")).returncode == 1


def test_the_drift_rule_follows_the_recipe():
    """Only with speculation, on a server with acceptance counters (Triton exports none), at the recipe's fraction."""

    def alerts(path, *overrides, check_rules=True):
        recipe = load_recipe(path, list(overrides), check_rules=check_rules)
        return {r.get("alert") for g in rule_file(recipe, JOB)["groups"] for r in g["rules"]}

    llmapi = RECIPES / "stories-llmapi-fp8.yaml"
    assert "SpeculativeAcceptanceDrift" not in alerts(llmapi)
    assert "SpeculativeAcceptanceDrift" in alerts(llmapi, "speculative.decoding_type=NGram")
    # the engine target (lookahead decoding: only the rule is asked)
    engine = alerts(ONE_NODE, "speculative.decoding_type=lookahead_decoding", check_rules=False)
    assert "SpeculativeAcceptanceDrift" not in engine
    recipe = load_recipe(llmapi, ["speculative.decoding_type=NGram", "deploy.acceptance_drift_alert=0.5"])
    rules = {r.get("alert"): r for g in rule_file(recipe, JOB)["groups"] for r in g["rules"]}
    assert rules["SpeculativeAcceptanceDrift"]["expr"] == (
        "trtpipe:spec_acceptance:ratio < 0.5 * trtpipe:spec_acceptance:ratio_baseline"
    )


def test_multi_node_rules_page_on_its_own_slo():
    rules = {r.get("alert"): r for g in rule_file(load_recipe(MULTI_NODE), JOB)["groups"] for r in g["rules"]}
    assert rules["TTFTAboveSLO"]["expr"] == "trtpipe:ttft_seconds:p99 > 3"
    assert "ITLAboveSLO" not in rules  # Triton exports no per-token latency
