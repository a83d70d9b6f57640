"""Per-adapter monitoring: the OpenAI twin's ``trtpipe_lora_*`` series (requests, tokens, adapter cache) and the
LoRA info gauge with vLLM's labels; the recipe's per-adapter recording rules and alert run by promtool on the very
series a twin exported in this test, and every dashboard query names a series the twin exports or a rule records.

The executor test steps the executor by hand (no thread, no clock), so which adapters ran in a step is decided,
not raced."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from lora_adapters import make_all
from trtpipe.serving.adapters import AdapterCache, LoraStepEngine
from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import ExecutorCore
from trtpipe.serving.lora_metrics import FAMILIES, LoraCounters, label_value, prometheus_lines
from trtpipe.serving.reference_engine import ReferenceEngine

PROMPTS = [[1, 403, 407, 261, 378, 261, 300], [1, 365, 1, 300, 403, 407, 261, 378, 299], [1, 343, 300, 400, 31]]
LABELS = 'model_name="m",engine_type="trtllm"'
SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<labels>.*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in LABEL.findall(m.group("labels"))}
            out.append((m.group("name"), labels, float(m.group("value"))))
    return out


def by_adapter(text: str, name: str) -> dict[str, float]:
    got: Counter = Counter()
    for n, labels, v in samples(text):
        if n == name:
            got[labels["lora_name"]] += v
    return dict(got)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, stories_dir):
    return make_all(stories_dir, tmp_path_factory.mktemp("lora"))


class Recording:
    """The real LoRA engine, recording the distinct adapters of every step it runs."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []

    def allocate(self, *a):
        self.engine.allocate(*a)

    def copy_block(self, *a):
        self.engine.copy_block(*a)

    def step(self, batch):
        self.steps.append({e.lora for e in batch.entries if e.lora is not None})
        return self.engine.step(batch)


@pytest.mark.slow
def test_running_waiting_and_cache_counters_per_adapter(stories_dir, adapters):
    """max_loras 2, three adapters submitted together: after one step two run and the third waits (vLLM's labels);
    at the end every adapter's hits + misses equal the steps that ran it, and the totals match the cache's."""
    from trtpipe.runtime.hf_loader import load_hf_checkpoint

    names = ["r8-attn", "r64-all", "r8-all-rslora"]
    cache = AdapterCache(stories_dir, 2, 8, max_rank=64)
    for n in names:
        cache.register(n, adapters[n])
    engine = LoraStepEngine(ReferenceEngine(load_hf_checkpoint(stories_dir)), cache)
    rec = Recording(engine)
    config = ExecutorConfig(
        max_batch_size=8,
        max_num_tokens=128,
        max_input_len=96,
        max_seq_len=128,
        num_blocks=96,
        tokens_per_block=8,
        max_loras=2,
    )
    core = ExecutorCore(config, rec, lambda r: None)
    counters = LoraCounters()
    for prompt, n in zip(PROMPTS, names):
        core.submit(Request(prompt, 6, end_id=2, exclude_input_from_output=True, lora=n))
        counters.begin(n)
    core.submit(Request(PROMPTS[0], 6, end_id=2, exclude_input_from_output=True))  # the base: no adapter series
    core.iterate()
    (info,) = [s for s in samples("\n".join(prometheus_lines(counters, engine, LABELS, 2))) if "info" in s[0]]
    assert info[1]["max_lora"] == "2"
    assert info[1]["running_lora_adapters"] == "r8-attn,r64-all"  # scheduling order, two of them
    assert info[1]["waiting_lora_adapters"] == "r8-all-rslora"
    assert info[2] == pytest.approx(engine.last_step[0]) and info[2] > 1.7e9  # unix time of that step
    core.run_until_idle()
    for n in names:
        counters.end(n)
    text = "\n".join(prometheus_lines(counters, engine, LABELS, 2))
    steps = Counter(n for s in rec.steps for n in s)
    hits, misses = (
        by_adapter(text, "trtpipe_lora_cache_hits_total"),
        by_adapter(text, "trtpipe_lora_cache_misses_total"),
    )
    assert {n: hits[n] + misses[n] for n in names} == {n: steps[n] for n in names}
    assert all(misses[n] >= 1 for n in names) and sum(misses.values()) == cache.stats.activations
    evicted = by_adapter(text, "trtpipe_lora_cache_evictions_total")
    assert sum(evicted.values()) == cache.stats.device_evictions > 0  # three adapters through two slots
    assert by_adapter(text, "trtpipe_lora_cache_loads_total") == {n: 1 for n in names}  # read once, at register
    (info,) = [s for s in samples(text) if "info" in s[0]]
    assert info[1]["running_lora_adapters"] == info[1]["waiting_lora_adapters"] == ""  # nothing in flight


def test_label_values_are_escaped():
    assert label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    text = f'x{{lora_name="{label_value(chr(34) + "q")}"}} 1'
    assert samples(text) == [("x", {"lora_name": '"q'}, 1.0)]


# --- the OpenAI twin over HTTP, and the rules on what it exported --------------------------------------------

JOB = "j"


@pytest.fixture(scope="module")
def scraped(stories_dir, adapters):
    """Serve three adapters (max_loras 2) and the base, run a concurrent mixed load, scrape once it is done."""
    pytest.importorskip("aiohttp")
    from openai_helpers import serve_in_thread

    from trtpipe.serving.adapters import LoraSettings
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    names = ["r8-attn", "r64-all", "r8-all-rslora"]
    model = ServedModel(
        stories_dir,
        "stories-lora",
        lora=LoraSettings({n: adapters[n] for n in names}, max_lora_rank=64, max_loras=2, max_cpu_loras=4),
    )
    jobs = [(n, p) for n in names for p in ("Once upon a time", "The little dog")] + [(None, "One day")] * 2
    with serve_in_thread(OpenAIServer(model).app) as url:

        def run(job):
            lora, prompt = job
            body = {"model": lora or "stories-lora", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return lora, r.json()["usage"]

        with ThreadPoolExecutor(len(jobs)) as pool:
            usages = list(pool.map(run, jobs))
        text = requests.get(f"{url}/prometheus/metrics", timeout=30).text
        yield text, usages, model


@pytest.mark.slow
def test_twin_exports_per_adapter_series(scraped):
    text, usages, model = scraped
    sent = Counter(lora for lora, _ in usages if lora)
    assert by_adapter(text, "trtpipe_lora_request_success_total") == dict(sent)
    for family, key in (("prompt", "prompt_tokens"), ("generation", "completion_tokens")):
        want = Counter()
        for lora, usage in usages:
            if lora:
                want[lora] += usage[key]
        assert by_adapter(text, f"trtpipe_lora_{family}_tokens_total") == dict(want), family
        (total,) = [v for n, _, v in samples(text) if n == f"trtllm_{family}_tokens_total"]
        assert total == sum(u[key] for _, u in usages)  # base = total - sum over adapters
    assert sum(by_adapter(text, "trtpipe_lora_cache_misses_total").values()) == model.adapters.stats.activations
    assert by_adapter(text, "trtpipe_lora_request_error_total") == {n: 0 for n in sent}
    assert {n for n, _, _ in samples(text) if n.startswith("trtpipe_lora")} == set(FAMILIES)
    if shutil.which("promtool"):  # the exposition parses (promtool exits 1 on a parse error, 3 on lint only)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode in (0, 3) and "error while linting" not in check.stderr, check.stderr


def _recipe(tmp_path, stories_dir, adapters):
    from trtpipe.app.validation import load_recipe

    doc = {
        "name": "stories-lora",
        "target": "llmapi",
        "model": {"source": str(stories_dir)},
        "accuracy": {"enabled": False},
        "engine": {"max_batch_size": 8, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 2048},
        "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, "max_lora_rank": 64, "max_loras": 2},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    return load_recipe(tmp_path / "recipe.yaml", check_rules=False)


@pytest.mark.slow
def test_dashboard_names_only_exported_or_recorded_series(tmp_path, stories_dir, adapters, scraped):
    from trtpipe.deploy.alerts import rule_file
    from trtpipe.deploy.dashboard import dashboard, expressions
    from trtpipe.deploy.metrics import NOT_IN_TWINS
    from trtpipe.deploy.promql import exported_names, metric_names

    text, _, _ = scraped
    recipe = _recipe(tmp_path, stories_dir, adapters)
    rules = rule_file(recipe, JOB)
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    board = dashboard(recipe, JOB)
    titles = [p["title"] for p in board["panels"]]
    assert "Output tokens/s by adapter" in titles and "Adapter device-cache miss ratio" in titles
    named = set().union(*(metric_names(e) for e in expressions(board)))
    for r in (r for g in rules["groups"] for r in g["rules"]):
        named |= metric_names(r["expr"])
    missing = named - exported_names(text) - recorded - set(NOT_IN_TWINS)
    assert missing == set(), missing
    assert {"trtpipe:lora_output_tokens:rate", "trtpipe:lora_cache_miss:ratio"} <= named


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (apt-get install prometheus)")
def test_per_adapter_rules_under_promtool_on_exported_series(tmp_path, stories_dir, adapters, scraped):
    """Input series: the label sets the twin exported, with job and instance added. One adapter misses the device
    cache on 3 of 4 steps (0.75 > 0.5: the alert fires naming it), another on 1 of 4 (0.25: silent); each adapter
    generates 15 tokens per 15 s (1 token/s recorded per adapter)."""
    from trtpipe.deploy.alerts import rule_file

    text, _, _ = scraped
    recipe = _recipe(tmp_path, stories_dir, adapters)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_file(recipe, JOB)))
    check = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    thrash, calm = "r8-attn", "r64-all"
    step = {
        ("trtpipe_lora_cache_misses_total", thrash): 3,
        ("trtpipe_lora_cache_hits_total", thrash): 1,
        ("trtpipe_lora_cache_misses_total", calm): 1,
        ("trtpipe_lora_cache_hits_total", calm): 3,
    }
    series = []
    for name, labels, _ in samples(text):
        if name == "trtpipe_lora_generation_tokens_total" or (name, labels.get("lora_name")) in step:
            per = 15 if name == "trtpipe_lora_generation_tokens_total" else step[name, labels["lora_name"]]
            sel = ",".join(f'{k}="{label_value(v)}"' for k, v in {**labels, "job": JOB, "instance": "i"}.items())
            series.append({"series": f"{name}{{{sel}}}", "values": f"0+{per}x60"})
    assert len(series) == 3 + 4  # three adapters' token counters, two adapters' hits and misses
    summary = (
        f"adapter {thrash} is activated into the device cache on 75% of its steps (over 0.5): raise "
        f"lora.max_loras (2) or route its requests together ({JOB})"
    )
    case = {
        "interval": "15s",
        "input_series": series,
        "alert_rule_test": [
            {
                "eval_time": "10m",
                "alertname": "LoraAdapterCacheThrashing",
                "exp_alerts": [
                    {
                        "exp_labels": {"recipe": recipe.name, "severity": "warning", "job": JOB, "lora_name": thrash},
                        "exp_annotations": {"summary": summary},
                    }
                ],
            }
        ],
        "promql_expr_test": [
            {
                "expr": "trtpipe:lora_output_tokens:rate",
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f'trtpipe:lora_output_tokens:rate{{job="{JOB}",lora_name="{n}"}}', "value": 1}
                    for n in ("r64-all", "r8-all-rslora", "r8-attn")
                ],
            },
            {
                "expr": "trtpipe:lora_cache_miss:ratio",
                "eval_time": "10m",
                "exp_samples": [
                    {"labels": f'trtpipe:lora_cache_miss:ratio{{job="{JOB}",lora_name="{n}"}}', "value": v}
                    for n, v in ((calm, 0.25), (thrash, 0.75))
                ],
            },
        ],
    }
    doc = {"rule_files": ["rules.yaml"], "evaluation_interval": "15s", "tests": [case]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # the harness can fail: the calm adapter expected to fire is reported
    case["alert_rule_test"][0]["exp_alerts"][0]["exp_labels"]["lora_name"] = calm
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    wrong = subprocess.run(["promtool", "test", "rules", str(tmp_path / "test.yaml")], capture_output=True, text=True)
    assert wrong.returncode == 1
