"""``trtpipe eval RECIPE --harness lm-eval --tasks ...``: the llmapi deployment (here INT4-AWQ weights) and the
unquantized stories260k are each served by the OpenAI twin in the trtpipe process and scored by
lm-evaluation-harness on the shipped tasks (tasks/lm_eval), offline, from a working directory outside the
repository. Checked against what the harness does not compute: the reference's stories_mc accuracy from transformers
in float64, and each SE from the binomial formula lm_eval's ``mean_stderr`` reduces to (sample stddev / sqrt(n)).
The gate's rule (fail when drop > max_drop + 2 SE) is checked task by task at a --max-drop that fails one task.
``TRTPIPE_HARNESS_RESULT=docs/results/lm_eval_gate.md`` writes the run's numbers there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from optional import needs

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "stories-llmapi-fp8.yaml"
INT4 = [  # recipes/stories-int4-awq.yaml's quantization on the llmapi recipe (group 64: stories260k's widths)
    "quantization.algo=int4_awq",
    "quantization.kv_cache=none",
    "quantization.group_size=64",
    'quantization.exclude=["*lm_head","*mlp.proj"]',
]
TASKS = "stories_mc,stories_gen"


def test_an_engine_target_is_refused_in_one_line():
    from trtpipe.cli import main

    res = CliRunner().invoke(
        main, ["eval", str(REPO / "recipes" / "stories-fp8.yaml"), "--harness", "lm-eval", "--tasks", "stories_mc"]
    )
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "target: engine" in lines[0] and "no OpenAI endpoint" in lines[0], res.output
    assert "--set target=llmapi" in lines[0]


def test_harness_options_need_the_harness():
    from trtpipe.cli import main

    res = CliRunner().invoke(main, ["eval", str(RECIPE), "--max-drop", "0.1"])
    assert res.exit_code == 2 and "--max-drop: only with --harness lm-eval" in res.output


def test_the_gate_rule_per_task():
    """drop = reference - quantized (higher is better); fail iff drop > max_drop + 2 sqrt(se_q^2 + se_r^2)."""
    from trtpipe.app.harness import scores

    def out(acc, se):
        return {
            "configs": {"t": {"metric_list": [{"metric": "acc"}]}},
            "results": {"t": {"alias": "t", "acc,none": acc, "acc_stderr,none": se}},
            "higher_is_better": {"t": {"acc": True}},
        }

    se = math.hypot(0.03, 0.04)  # 0.05
    for quantized, max_drop, verdict in (
        (0.72, 0.0, "pass"),
        (0.70, -0.01, "FAIL"),
        (0.60, 0.09, "FAIL"),
        (0.6, 0.11, "pass"),
    ):
        (row,) = scores(out(0.80, 0.03), out(quantized, 0.04), ["t"], max_drop)
        assert row.se == pytest.approx(se, rel=1e-15) and row.delta == pytest.approx(quantized - 0.80, rel=1e-15)
        assert row.verdict == verdict, (quantized, max_drop, row)
    (row,) = scores(out(0.8, "N/A"), out(0.8, "N/A"), ["t"], None)  # one document: the harness has no SE
    assert row.se is None and row.verdict == "-"


def trtpipe(args, env, cwd):
    return subprocess.run(
        [sys.executable, "-m", "trtpipe.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=900
    )


def _reference_mc_acc_float64(stories_dir: Path) -> float:
    """stories_mc accuracy of the unquantized model from transformers in float64 (BOS first, as the harness asks)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stories_dir)
    model = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float64).eval()
    hits, docs = 0, [json.loads(x) for x in (REPO / "tasks/lm_eval/stories_mc.jsonl").read_text().splitlines()]
    for d in docs:
        lls = []
        for choice in d["choices"]:
            ctx, whole = tok(d["context"]).input_ids, tok(d["context"] + choice).input_ids
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0], -1)
            lls.append(sum(float(lp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
        hits += max(range(len(lls)), key=lls.__getitem__) == d["label"]
    return hits / len(docs)


@pytest.mark.slow
@needs("aiohttp", "lm_eval")
def test_eval_harness_int4_against_the_unquantized_model(tmp_path, stories_dir):
    env = {
        **os.environ,
        "TRTPIPE_CACHE": str(tmp_path / "cache"),
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
        "PYTHONPATH": str(REPO),
    }
    sets = [f"work_dir={tmp_path / 'work'}", f"model.source={stories_dir}", *INT4]
    args = ["eval", str(RECIPE), *[a for s in sets for a in ("--set", s)], "--harness", "lm-eval", "--tasks", TASKS]
    cwd = tmp_path / "elsewhere"  # not the repository: the shipped tasks' data paths must not depend on it
    cwd.mkdir()
    ok = trtpipe(args, env, cwd)
    assert ok.returncode == 0, ok.stderr[-3000:]
    (result,) = (tmp_path / "work" / "harness").glob("lm-eval-*.json")
    doc = json.loads(result.read_text())
    rows = {t["task"]: t for t in doc["tasks"]}
    assert list(rows) == ["stories_mc", "stories_gen"] and doc["reference"] == str(stories_dir)
    assert "artifacts/export" in doc["quantized"]
    n = {"stories_mc": 12, "stories_gen": 6}
    for name, t in rows.items():
        assert t["delta"] == t["quantized"] - t["reference"] and t["verdict"] == "-"
        for p, se in ((t["reference"], t["se_reference"]), (t["quantized"], t["se_quantized"])):
            assert se == pytest.approx(math.sqrt(p * (1 - p) / (n[name] - 1)), rel=1e-12), (name, p, se)
        assert t["se"] == pytest.approx(math.hypot(t["se_reference"], t["se_quantized"]), rel=1e-12)
        line = next(x for x in ok.stdout.splitlines() if x.startswith(name))
        assert f"{t['delta']:+.4f}" in line and f"{t['se']:.4f}" in line, line
    assert rows["stories_mc"]["reference"] == _reference_mc_acc_float64(stories_dir)
    # the deployment served is the INT4 one: its loglikelihoods differ from the reference's (48 = 12 docs x 4)
    mc, gen = doc["answers"]["stories_mc"], doc["answers"]["stories_gen"]
    assert mc["loglikelihoods"] == 48 and mc["max_abs_diff"] > 0 and gen["generations"] == 6
    assert "lm-eval ran " in ok.stdout
    print("\n" + ok.stdout)

    # a --max-drop that the stories_mc numbers exceed by 0.01 beyond 2 SE: that task fails, named in one line
    mc = rows["stories_mc"]
    max_drop = round(-mc["delta"] - 2 * mc["se"] - 0.01, 4)
    bad = trtpipe([*args, "--max-drop", str(max_drop)], env, cwd)
    assert bad.returncode == 1, bad.stdout + bad.stderr[-2000:]
    err = [x for x in bad.stderr.splitlines() if x.startswith("lm-eval task ")]
    assert len(err) == 1 and err[0].startswith("lm-eval task stories_mc: acc delta"), bad.stderr[-2000:]
    assert f"--max-drop {max_drop:g} + 2 SE" in err[0]
    newest = json.loads(max((tmp_path / "work" / "harness").glob("lm-eval-*.json")).read_text())
    for t in newest["tasks"]:
        assert t["verdict"] == ("FAIL" if t["drop"] > max_drop + 2 * t["se"] else "pass"), t
    print(bad.stdout + err[0])
    # trtpipe report shows the newest result of the recipe in a note line
    from trtpipe.app.deploy_report import build_report

    report = build_report([RECIPE], sets, tmp_path / "report")["text"]
    note = next(x for x in report.splitlines() if x.startswith("stories-llmapi-fp8: lm-eval "))
    assert f"--max-drop {max_drop:g}: stories_mc acc" in note and "FAIL" in note, note
    out = os.environ.get("TRTPIPE_HARNESS_RESULT")
    if out:
        Path(out).write_text(_markdown(sets, ok.stdout, doc, max_drop, bad, err[0]))


def _markdown(sets, table, doc, max_drop, bad, err) -> str:
    from importlib.metadata import version

    libs = ", ".join(f"{p} {version(p)}" for p in ("lm_eval", "transformers", "torch", "datasets"))
    cmd = "trtpipe eval recipes/stories-llmapi-fp8.yaml " + " ".join(
        f"--set '{s}'" for s in sets if not s.startswith(("work_dir", "model.source"))
    )
    lines = [
        "# `trtpipe eval --harness lm-eval`: INT4-AWQ stories260k against the unquantized model",
        "",
        "Written by `TRTPIPE_HARNESS_RESULT=docs/results/lm_eval_gate.md PYTHONPATH=$PWD .venv/bin/pytest -q -s "
        f"-p no:cacheprovider tests/export/test_eval_harness.py` ({libs}; the CPU twin on a shared 2-core machine).",
        "The deployment is the llmapi export of recipes/stories-llmapi-fp8.yaml with INT4-AWQ weights (group 64, "
        "`*mlp.proj` and `lm_head` kept; float16 activations, no KV-cache quantization); the reference is "
        "models/stories260k (float32) served the same way. Tasks: tasks/lm_eval (12 and 6 documents).",
        "",
        "```",
        f"{cmd} --harness lm-eval --tasks {TASKS}",
        "```",
        "",
        "```",
        "\n".join(x for x in table.splitlines() if not x.startswith(("lm-eval stories", "lm-eval ran"))),
        next(x for x in table.splitlines() if x.startswith("lm-eval ran")).split("; result")[0]
        + " (this run: nothing cached)",
        "```",
        "",
        f"Exit 0. With `--max-drop {max_drop:g}` (the stories_mc drop, less 2 SE, less 0.01) the same run exits "
        f"{bad.returncode}:",
        "",
        "```",
        err,
        "```",
        "",
        "The rule: a task fails when `drop > max_drop + 2 * SE`, `drop = reference - quantized` (higher is better), "
        "`SE = sqrt(se_q^2 + se_r^2)` from the harness's standard errors. On 12 and 6 documents the SE is 0.12 and "
        "0.3 or more: these tiny tasks show the mechanism, not INT4's cost; a real gate needs hundreds of documents "
        "per task.",
        "",
        "The answers differ (the INT4 loglikelihoods move by the amounts above, some greedy generations change) "
        "while both task metrics stay put: on 12 and 6 documents the metrics cannot see it.",
        "",
        "The reference's stories_mc accuracy equals transformers' in float64 on the same tokens "
        f"({doc['tasks'][0]['reference']:.4f}); each SE equals sqrt(p(1-p)/(n-1)) (lm_eval's mean_stderr).",
    ]
    return "\n".join(lines) + "\n"
