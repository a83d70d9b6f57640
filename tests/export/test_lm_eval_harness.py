"""lm-evaluation-harness scores the OpenAI twin as it scores the model itself: its ``local-completions`` backend
through the served endpoint (token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1`` for every
loglikelihood; greedy ``generate_until`` with stop strings) against its own ``hf`` backend on the same stories260k
checkpoint, on the two small tasks trtpipe ships under tasks/lm_eval (no hub access).

Per sample: each backend's loglikelihood lies within ``n_tokens x ORDER_FACTOR x`` the float32 error scale of
transformers' float64 log-softmax on the same tokens (tests/numerics.py), ``is_greedy`` agrees, and the greedy
generations are equal. ``TRTPIPE_LM_EVAL_RESULT=docs/results/lm-eval-twin.md`` writes the run's numbers there."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from numerics import ORDER_FACTOR, U32, error_scale
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, needs("aiohttp", "lm_eval")]

TASKS = ["stories_mc", "stories_gen"]
NAME = "stories"


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return tmp_path


def _evaluate(model: str, model_args: str, tmp: Path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from trtpipe.app.harness import shipped_include_dir

    # the shipped YAMLs with their data paths made absolute: any working directory works
    tm = TaskManager(include_path=str(shipped_include_dir(tmp / "tasks")))
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=tm, log_samples=True, batch_size=1
    )
    return out["results"], out["samples"]


def test_local_completions_through_the_twin_equals_the_hf_backend(offline, stories_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    # both backends put the BOS token first, as the model was trained (the hf backend's default for this tokenizer)
    t0 = time.perf_counter()
    hf_results, hf = _evaluate("hf", f"pretrained={stories_dir},dtype=float32,add_bos_token=True,device=cpu", offline)
    t_hf = time.perf_counter() - t0
    served = ServedModel(stories_dir, NAME)
    with serve_in_thread(OpenAIServer(served).app) as url:
        args = (
            f"base_url={url}/v1/completions,model={NAME},tokenizer={stories_dir},tokenizer_backend=huggingface,"
            "tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1"
        )
        t0 = time.perf_counter()
        twin_results, twin = _evaluate("local-completions", args, offline)
        t_twin = time.perf_counter() - t0

    tok = AutoTokenizer.from_pretrained(stories_dir)
    hf32 = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    hf64 = AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float64).eval()
    worst_twin_hf, worst_ratio, n_ll, rows = 0.0, 0.0, 0, []
    for a, b in zip(hf["stories_mc"], twin["stories_mc"], strict=True):
        assert a["doc_id"] == b["doc_id"]
        for choice, (ra,), (rb,) in zip(a["doc"]["choices"], a["resps"], b["resps"], strict=True):
            context = a["doc"]["context"]
            whole, ctx = tok(context + choice).input_ids, tok(context).input_ids
            with torch.no_grad():
                lp64 = torch.log_softmax(hf64(torch.tensor([whole])).logits[0].double(), -1)
                lp32 = torch.log_softmax(hf32(torch.tensor([whole])).logits[0].float(), -1)
            cont = range(len(ctx), len(whole))
            ll64 = sum(float(lp64[i - 1, whole[i]]) for i in cont)
            bound = len(cont) * ORDER_FACTOR * error_scale(lp32, lp64, U32)
            for label, (ll, greedy) in (("hf", ra), ("twin", rb)):
                assert abs(ll - ll64) <= bound, (label, a["doc_id"], choice, ll, ll64, bound)
            margin = min(float(lp64[i - 1].topk(2).values.diff().abs()) for i in cont)
            assert ra[1] == rb[1] or margin <= 2 * bound, (a["doc_id"], choice)
            rows.append((a["doc_id"], choice, ra[0], rb[0], ll64, abs(rb[0] - ra[0]), bound, ra[1], rb[1]))
            worst_twin_hf = max(worst_twin_hf, abs(ra[0] - rb[0]))
            worst_ratio = max(worst_ratio, abs(rb[0] - ll64) / bound)
            n_ll += 1
    gens = [(a["resps"][0][0], b["resps"][0][0]) for a, b in zip(hf["stories_gen"], twin["stories_gen"], strict=True)]
    assert all(x == y for x, y in gens), gens
    assert sum(bool(x) for x, _ in gens) >= 4, gens  # the task generates text, not empty strings
    assert twin_results["stories_mc"]["acc,none"] == hf_results["stories_mc"]["acc,none"]
    print(
        f"\nlm-eval local-completions (twin) vs hf on stories260k: {n_ll} loglikelihoods, max |twin - hf| = "
        f"{worst_twin_hf:.3g}, max |twin - float64| / bound = {worst_ratio:.3g}; acc twin "
        f"{twin_results['stories_mc']['acc,none']:.4f} hf {hf_results['stories_mc']['acc,none']:.4f}; "
        f"generations equal {len(gens)}/{len(gens)}: {[g for g, _ in gens]}"
    )
    out = os.environ.get("TRTPIPE_LM_EVAL_RESULT")
    if out:
        _write(Path(out), rows, gens, hf_results, twin_results, worst_twin_hf, worst_ratio, t_hf, t_twin)


def _write(path: Path, rows, gens, hf_results, twin_results, worst, ratio, t_hf, t_twin) -> None:
    from importlib.metadata import version

    libs = ", ".join(f"{p} {version(p)}" for p in ("lm_eval", "transformers", "torch", "datasets", "pyarrow"))
    lines = [
        "# lm-evaluation-harness through the OpenAI twin vs its hf backend (stories260k)",
        "",
        "Written by `TRTPIPE_LM_EVAL_RESULT=docs/results/lm-eval-twin.md PYTHONPATH=$PWD .venv/bin/pytest -q "
        f"-p no:cacheprovider tests/export/test_lm_eval_harness.py` ({libs}; float32 on the CPU; the tasks "
        "are tasks/lm_eval/stories_mc.yaml and stories_gen.yaml). `twin`: `local-completions` against the "
        "OpenAI twin serving models/stories260k (token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`); `hf`: "
        "the harness's own transformers backend; `float64`: transformers in float64 on the same tokens; `bound`: "
        "continuation tokens x 4 x the float32 error scale of transformers' log-softmax (tests/numerics.py).",
        "",
        f"- loglikelihoods: {len(rows)}; max |twin - hf| = {worst:.3g}; max |twin - float64| / bound = {ratio:.3g}",
        f"- stories_mc acc: twin {twin_results['stories_mc']['acc,none']:.4f}, "
        f"hf {hf_results['stories_mc']['acc,none']:.4f}",
        f"- stories_gen greedy generations equal: {sum(x == y for x, y in gens)}/{len(gens)}",
        f"- wall time (shared 2-core machine, not a benchmark): hf {t_hf:.1f} s, twin {t_twin:.1f} s",
        "",
        "| doc | choice | hf | twin | float64 | abs(twin - hf) | bound | greedy hf/twin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for doc, choice, a, b, ll64, d, bound, ga, gb in rows:
        lines.append(f"| {doc} | `{choice}` | {a:.6f} | {b:.6f} | {ll64:.6f} | {d:.2e} | {bound:.2e} | {ga}/{gb} |")
    lines += ["", "| doc | hf generation | twin generation |", "|---|---|---|"]
    lines += [f"| {i} | `{x}` | `{y}` |" for i, (x, y) in enumerate(gens)]
    path.write_text("\n".join(lines) + "\n")
