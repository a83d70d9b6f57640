"""End to end: a real Prometheus (Debian's 2.42) on 127.0.0.1 scrapes the OpenAI twin (trtllm-serve's metric
names) with the rule file of `trtpipe deploy monitoring`; a load that overfills a small KV pool drives
KVCacheNearlyFull to `firing`, the recording rules carry values (Prometheus's HTTP API), every dashboard query
parses in Prometheus and names only what the twin exports; then the load stops and the alert resolves.

Short windows (1 s scrape and evaluation, ``for: 2s``) keep it to seconds; every wait polls to a deadline and no
sleep is an assertion.
"""

from __future__ import annotations

import json
import shutil
import threading
import urllib.parse
import urllib.request

import pytest
from deploy_helpers import RECIPES
from openai_helpers import serve_in_thread
from prometheus_helpers import get, poll, prometheus, query

from trtpipe.deploy.alerts import Timing, rule_file
from trtpipe.deploy.dashboard import dashboard, expressions
from trtpipe.deploy.metrics import NOT_IN_TWINS
from trtpipe.deploy.monitoring import write_monitoring
from trtpipe.deploy.promql import exported_names, metric_names
from trtpipe.app.validation import load_recipe
from optional import needs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus (apt-get install prometheus)"),
    needs("aiohttp"),
]

FAST = Timing(interval="1s", rate="10s", short_rate="5s", slo_for="2s", kv_for="2s", down_for="2s")
# 16 blocks of 32 tokens (one max-length sequence of 512; serving.config's floor); max_utilization admits
# greedily: eight streams of 5 + 240 tokens (within max_input_len 256, as a pausing policy without chunked context
# requires) need 64 blocks, so the pool stays (nearly) full while they run.
OVERRIDES = [
    "engine.kv_cache.max_tokens=512",
    "engine.kv_cache.enable_reuse=false",
    "triton.scheduler_policy=max_utilization",
    "deploy.kv_cache_alert=0.9",
]


@pytest.fixture(scope="module")
def export(stories_fp16_export):
    return stories_fp16_export


def _load(url: str, stop: threading.Event, errors: list):
    body = json.dumps(
        {"model": "twin", "prompt": "Once upon a time", "max_tokens": 240, "temperature": 1.0, "seed": 1}
    ).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        except Exception as exc:  # noqa: BLE001 - collected; the test fails on them
            errors.append(exc)
            return


def test_kv_alert_fires_under_load_and_resolves_after_it(tmp_path, export):
    from trtpipe.serving.config import from_recipe
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    recipe = load_recipe(RECIPES / "stories-llmapi-fp8.yaml", OVERRIDES)
    served = ServedModel(export, "twin", from_recipe(recipe, 512))
    assert served.config.num_blocks == 16
    try:
        with serve_in_thread(OpenAIServer(served).app) as url:
            _run(tmp_path, recipe, url)
    finally:
        served.shutdown()


def _run(tmp_path, recipe, url):
    twin = url.removeprefix("http://")
    write_monitoring(recipe, tmp_path / "mon", targets=[twin], timing=FAST)
    with prometheus(tmp_path / "mon", tmp_path) as api:
        _scrape_under_load(api, recipe, url, twin)


def _scrape_under_load(api, recipe, url, twin):
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(url, stop, errors), daemon=True) for _ in range(8)]

    def kv_state():
        alerts = get(f"{api}/alerts")["data"]["alerts"]
        return [a["state"] for a in alerts if a["labels"]["alertname"] == "KVCacheNearlyFull"]

    try:
        poll(
            "the twin scraped (up == 1)",
            lambda: [r for r in query(api, f'up{{job="{recipe.name}"}}') or [] if r["value"][1] == "1"],
        )
        for t in threads:
            t.start()
        poll("KVCacheNearlyFull firing", lambda: errors or "firing" in kv_state())
        assert not errors, errors[0]
        # the recording rules carry values read back through the API
        # (the recorded series over the last minute: the value now may already be below the threshold)
        kv = query(api, "max_over_time(trtpipe:kv_cache_fraction:max[1m])")
        assert kv and float(kv[0]["value"][1]) > 0.9, kv
        assert kv[0]["metric"]["instance"] == twin and kv[0]["metric"]["job"] == recipe.name
        print(f"KV fraction recorded (max over 1 m): {kv[0]['value'][1]}")
        poll(
            "throughput recorded",
            lambda: [r for r in query(api, "trtpipe:output_tokens:rate") or [] if float(r["value"][1]) > 0],
        )
        poll(
            "TTFT p50 recorded",
            lambda: [r for r in query(api, "trtpipe:ttft_seconds:p50") or [] if float(r["value"][1]) > 0],
        )
        poll("queue/compute ratio recorded", lambda: query(api, "trtpipe:queue_compute:ratio"))
        # every dashboard query parses in Prometheus, and names only what the twin exports or the rules record
        board = dashboard(recipe, recipe.name)
        for expr in expressions(board):
            assert get(f"{api}/query?query={urllib.parse.quote(expr)}")["status"] == "success", expr
        with urllib.request.urlopen(url + "/prometheus/metrics") as r:
            exported = exported_names(r.read().decode())
        recorded = {r["record"] for g in rule_file(recipe, recipe.name)["groups"] for r in g["rules"] if "record" in r}
        used = set().union(
            *(metric_names(e) for e in expressions(board)),
            *(metric_names(r["expr"]) for g in rule_file(recipe, recipe.name)["groups"] for r in g["rules"]),
        )
        assert used - exported - recorded <= set(NOT_IN_TWINS), used - exported - recorded - set(NOT_IN_TWINS)
        assert {"trtllm_kv_cache_utilization", "trtllm_time_to_first_token_seconds_bucket"} <= used & exported
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(180)
    poll("KVCacheNearlyFull resolved", lambda: not kv_state())
    resolved = query(api, "trtpipe:kv_cache_fraction:max")
    assert float(resolved[0]["value"][1]) <= 0.9
