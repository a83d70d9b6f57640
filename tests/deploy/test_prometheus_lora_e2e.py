"""End to end, split by adapter: a real Prometheus (Debian's 2.42) scrapes the OpenAI twin serving three LoRA
adapters and the base under a mixed load, with the rule file of `trtpipe deploy monitoring` for a recipe with those
adapters. Every rule evaluates healthy in Prometheus, the per-adapter recording rules carry a series per adapter
(output tokens/s above 0 for each), and every dashboard query parses and names only what the twin exports or the
rules record. Every wait polls to a deadline; no sleep is an assertion."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.parse
import urllib.request

import pytest
import yaml
from openai_helpers import serve_in_thread
from optional import needs
from prometheus_helpers import get, poll, prometheus, query
from test_prometheus_e2e import FAST

from trtpipe.deploy.alerts import rule_file
from trtpipe.deploy.dashboard import dashboard, expressions
from trtpipe.deploy.metrics import NOT_IN_TWINS
from trtpipe.deploy.monitoring import write_monitoring
from trtpipe.deploy.promql import exported_names, metric_names

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus (apt-get install prometheus)"),
    needs("aiohttp"),
]
NAMES = ["r8-attn", "r64-all", "r8-all-rslora"]


def _recipe(tmp_path, stories_dir, adapters):
    from trtpipe.app.validation import load_recipe

    doc = {
        "name": "stories-lora",
        "target": "llmapi",
        "model": {"source": str(stories_dir)},
        "accuracy": {"enabled": False},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 2048},
        "lora": {"adapters": {n: str(adapters[n]) for n in NAMES}, "max_lora_rank": 64, "max_loras": 2},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    return load_recipe(tmp_path / "recipe.yaml", check_rules=False)


def _load(url: str, k: int, stop: threading.Event, errors: list):
    models = [*NAMES, "twin"]
    i = k
    while not stop.is_set():
        body = {"model": models[i % 4], "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        except Exception as exc:  # noqa: BLE001 - collected; the test fails on them
            errors.append(exc)
            return
        i += 1


def test_per_adapter_rules_record_in_prometheus(tmp_path, stories_dir):
    from lora_adapters import make_all

    from trtpipe.serving.adapters import LoraSettings
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    adapters = make_all(stories_dir, tmp_path / "lora")
    recipe = _recipe(tmp_path, stories_dir, adapters)
    served = ServedModel(
        stories_dir,
        "twin",
        lora=LoraSettings({n: adapters[n] for n in NAMES}, max_lora_rank=64, max_loras=2, max_cpu_loras=4),
    )
    try:
        with serve_in_thread(OpenAIServer(served).app) as url:
            _run(tmp_path, recipe, url)
    finally:
        served.shutdown()


def _run(tmp_path, recipe, url):
    write_monitoring(recipe, tmp_path / "mon", targets=[url.removeprefix("http://")], timing=FAST)
    with prometheus(tmp_path / "mon", tmp_path) as api:
        _scrape_under_load(api, recipe, url)


def _scrape_under_load(api, recipe, url):
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(url, k, stop, errors), daemon=True) for k in range(8)]
    try:
        poll(
            "the twin scraped",
            lambda: [r for r in query(api, f'up{{job="{recipe.name}"}}') or [] if r["value"][1] == "1"],
        )
        for t in threads:
            t.start()

        def per_adapter(record: str, positive: bool):
            rows = query(api, record) or []
            return {r["metric"]["lora_name"] for r in rows if not positive or float(r["value"][1]) > 0} >= set(NAMES)

        poll(
            "output tokens/s recorded for every adapter",
            lambda: errors or per_adapter("trtpipe:lora_output_tokens:rate", True),
        )
        assert not errors, errors[0]
        poll("requests/s recorded for every adapter", lambda: per_adapter("trtpipe:lora_requests:rate", True))
        poll("miss ratio recorded for every adapter", lambda: per_adapter("trtpipe:lora_cache_miss:ratio", False))
        base = "trtpipe:output_tokens:rate - on (job) sum by (job) (trtpipe:lora_output_tokens:rate)"
        poll("the base model's share recorded", lambda: [r for r in query(api, base) or [] if float(r["value"][1]) > 0])

        def rules_health():
            groups = get(f"{api}/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None

        rules = poll("every rule evaluated", rules_health)
        bad = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
        assert bad == {}, bad
        assert {"LoraAdapterCacheThrashing", "trtpipe:lora_cache_miss:ratio"} <= {r["name"] for r in rules}
        board = dashboard(recipe, recipe.name)
        for expr in expressions(board):
            assert get(f"{api}/query?query={urllib.parse.quote(expr)}")["status"] == "success", expr
        with urllib.request.urlopen(url + "/prometheus/metrics") as r:
            exported = exported_names(r.read().decode())
        rules_doc = rule_file(recipe, recipe.name)
        recorded = {r["record"] for g in rules_doc["groups"] for r in g["rules"] if "record" in r}
        used = set().union(
            *(metric_names(e) for e in expressions(board)),
            *(metric_names(r["expr"]) for g in rules_doc["groups"] for r in g["rules"]),
        )
        assert used - exported - recorded <= set(NOT_IN_TWINS), used - exported - recorded - set(NOT_IN_TWINS)
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(180)
