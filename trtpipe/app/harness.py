"""``trtpipe eval RECIPE --harness lm-eval --tasks T[,T..]``: the deployment scored the way users score it.

The built deployment of a ``target: llmapi`` recipe (its export, as ``trtpipe serve`` serves it) and the unquantized
reference (``accuracy.reference`` when set, else ``model.source``) are each served by the OpenAI twin
(:mod:`trtpipe.serving.openai_server`) in this process, on a loopback port the OS picks, and lm-evaluation-harness
(``lm_eval.simple_evaluate``, model ``local-completions``: token-id prompts, ``echo``/``logprobs`` for
loglikelihoods, greedy ``generate_until``) scores both, offline (no hub: ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``).

The gate, per task, on its main metric (the first of the task's ``metric_list``): ``delta = quantized - reference``,
``SE = sqrt(se_q^2 + se_r^2)`` from the harness's own standard errors, ``drop = -delta`` (``+delta`` when lower is
better). The task fails when ``drop > max_drop + 2 SE``: a drop the samples cannot tell from ``max_drop`` passes.
The SE treats the two runs as independent; they score the same documents, so the paired SE is usually smaller and
the gate errs towards passing.

Task files: the tasks trtpipe ships (``tasks/lm_eval/`` at the repository root; their data paths are relative to
their YAML and are made absolute in a temporary include directory, so any working directory works) plus
``--include-path`` directories, passed to the harness as they are.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from trtpipe.errors import AccuracyGateError, Problem, RecipeError, ServingError

HARNESSES = ("lm-eval",)
TASKS_DIR = Path(__file__).resolve().parents[2] / "tasks" / "lm_eval"
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
SE_FACTOR = 2.0  # a task fails when its drop exceeds max_drop by more than this many standard errors
RESULT_FORMAT = "trtpipe-harness/1"


@dataclass
class TaskScore:
    """One task's main metric on the reference and on the deployment, and the gate's verdict."""

    task: str
    metric: str
    higher_is_better: bool
    reference: float
    quantized: float
    se_reference: Optional[float]  # None: the harness gave no standard error (e.g. one sample)
    se_quantized: Optional[float]
    delta: float  # quantized - reference
    se: Optional[float]
    verdict: str = "-"  # "pass", "FAIL", or "-" without --max-drop

    @property
    def drop(self) -> float:
        return -self.delta if self.higher_is_better else self.delta


def shipped_include_dir(dest: Path, source: Path = TASKS_DIR) -> Path:
    """Write the shipped task YAMLs into ``dest`` with their relative ``dataset_kwargs.data_files`` made absolute
    (relative to the YAML's own directory), so the harness finds the data from any working directory."""
    import yaml

    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        files = (doc.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            doc["dataset_kwargs"]["data_files"] = {
                split: str((path.parent / f).resolve()) if not Path(f).is_absolute() else f
                for split, f in files.items()
            }
        (dest / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


@contextmanager
def serve_in_thread(served) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` while the OpenAI twin serves ``served`` (a ServedModel) from a thread."""
    from trtpipe.serving.openai_server import OpenAIServer
    from trtpipe.serving.thread_server import serve_in_thread as serve_app

    with serve_app(OpenAIServer(served).app, f"the OpenAI twin on {served.dir}") as url:
        yield url


def model_args(url: str, served) -> str:
    """``local-completions`` arguments for the twin serving ``served``: token-id requests with the served model's
    own tokenizer, BOS first when that tokenizer has one (lm_eval/models/api_models.py of lm-evaluation-harness
    0.4.13: ``add_bos_token`` turns on ``add_special_tokens`` when encoding), and the executor's longest prompt
    (``max_input_len``) as the harness's ``max_length``, so the harness truncates what the server would refuse."""
    bos = served.tokenizer.bos_token_id is not None
    return (
        f"base_url={url}/v1/completions,model={served.name},tokenizer={served.dir},tokenizer_backend=huggingface,"
        f"tokenized_requests=True,add_bos_token={bos},max_length={served.config.max_input_len},num_concurrent=1,"
        "max_retries=1"
    )


def task_manager(tasks: Sequence[str], include_paths: Sequence[Path]):
    """lm-evaluation-harness's TaskManager over ``include_paths``; refuses a task name it does not know."""
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=[str(p) for p in include_paths])
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise usage(
            "--tasks",
            f"unknown to lm-evaluation-harness: {', '.join(unknown)} (shipped: "
            f"{', '.join(shipped_tasks()) or 'none'}; add task YAMLs with --include-path DIR)",
        )
    return tm


def evaluate(served, tasks: Sequence[str], tm, limit: Optional[int]) -> dict:
    """lm-evaluation-harness's results for ``tasks`` against the twin serving ``served``."""
    import lm_eval

    with serve_in_thread(served) as url:
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args(url, served),
            tasks=list(tasks),
            task_manager=tm,
            limit=limit,
            batch_size=1,
            log_samples=True,  # per-document answers: how far the two models' answers differ
        )


def usage(option: str, message: str) -> RecipeError:
    """A bad command-line value: one line naming the option (exit 2, as a bad recipe)."""
    return RecipeError([Problem(option, 0, 0, "", message)])


def shipped_tasks() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def _number(v) -> Optional[float]:
    try:
        x = float(v)
    except (TypeError, ValueError):  # the harness writes "N/A" where it has no standard error
        return None
    return x if math.isfinite(x) else None


def main_metric(out: dict, task: str) -> tuple[str, str, bool]:
    """(results key, metric name, higher is better) of the task's first metric (its first filter's value)."""
    metrics = [m["metric"] for m in (out["configs"][task].get("metric_list") or []) if isinstance(m, dict)]
    keys = [k for k in out["results"][task] if "," in k and "_stderr," not in k]
    for metric in metrics:
        key = next((k for k in keys if k.split(",", 1)[0] == metric), None)
        if key is not None:
            return key, metric, bool(out["higher_is_better"][task].get(metric, True))
    raise ServingError(f"lm-evaluation-harness reported no metric for task {task} (keys: {keys})")


def scores(reference: dict, quantized: dict, tasks: Sequence[str], max_drop: Optional[float]) -> list[TaskScore]:
    """Each task's main metric on both runs, with its delta, SE and (with ``max_drop``) verdict."""
    rows = []
    for task in tasks:
        key, metric, higher = main_metric(reference, task)
        stderr_key = key.replace(",", "_stderr,", 1)
        r, q = reference["results"][task], quantized["results"][task]
        se_r, se_q = _number(r.get(stderr_key)), _number(q.get(stderr_key))
        se = math.sqrt(se_r**2 + se_q**2) if se_r is not None and se_q is not None else None
        row = TaskScore(
            task, metric, higher, float(r[key]), float(q[key]), se_r, se_q, float(q[key]) - float(r[key]), se
        )
        if max_drop is not None:
            row.verdict = "FAIL" if row.drop > max_drop + SE_FACTOR * (se or 0.0) else "pass"
        rows.append(row)
    return rows


def answer_difference(reference: dict, quantized: dict, task: str) -> dict:
    """How far the two models' per-document answers differ, beyond the metric: the largest and mean absolute
    difference of the loglikelihoods (loglikelihood tasks), or how many generations are equal (generation tasks)."""
    lls, gens = [], []
    for a, b in zip(reference["samples"][task], quantized["samples"][task], strict=True):
        for ra, rb in zip(a["resps"], b["resps"], strict=True):
            x, y = ra[0], rb[0]
            if isinstance(x, str):
                gens.append(x == y)
            else:  # (loglikelihood, is_greedy)
                lls.append(abs(float(x[0]) - float(y[0])))
    if lls:
        mean = sum(lls) / len(lls)
        text = f"{len(lls)} loglikelihoods, |quantized - reference| max {max(lls):.4g}, mean {mean:.4g}"
        return {"loglikelihoods": len(lls), "max_abs_diff": max(lls), "mean_abs_diff": mean, "text": text}
    same = sum(gens)
    return {"generations": len(gens), "equal": same, "text": f"{same} of {len(gens)} generations equal"}


def render(rows: Sequence[TaskScore]) -> str:
    lines = [f"{'task':<22}{'metric':<14}{'reference':>10}{'quantized':>10}{'delta':>10}{'SE':>9}  verdict"]
    for r in rows:
        se = "n/a" if r.se is None else f"{r.se:.4f}"
        lines.append(
            f"{r.task:<22}{r.metric:<14}{r.reference:>10.4f}{r.quantized:>10.4f}{r.delta:>+10.4f}{se:>9}  {r.verdict}"
        )
    return "\n".join(lines)


def reference_dir(recipe) -> Path:
    """The unquantized model the deployment is measured against: ``accuracy.reference``, else ``model.source``."""
    if recipe.accuracy.reference is not None:
        from trtpipe.stages.quant import reference_dir as accuracy_reference

        return accuracy_reference(recipe)
    from trtpipe.stages.checkpoint import model_dir

    return model_dir(recipe)


def newest_result(recipe) -> Optional[Path]:
    """The newest harness result of this recipe (``<work_dir>/harness/*.json``), or None."""
    root = recipe.work_path / "harness"
    found = sorted(root.glob("lm-eval-*.json")) if root.is_dir() else []
    return found[-1] if found else None


def run_harness(
    recipe_path: Path,
    overrides: Sequence[str],
    harness: str,
    tasks: Sequence[str],
    include_paths: Sequence[Path],
    limit: Optional[int],
    max_drop: Optional[float],
    echo: Callable[[str], None],
) -> dict:
    """Serve both models, score both, print the table and write the result; raise AccuracyGateError naming the
    first failing task."""
    from trtpipe.app.launch_openai import resolve_openai_target
    from trtpipe.app.validation import load_recipe
    from trtpipe.serving.openai_server import ServedModel

    if harness not in HARNESSES:
        raise usage("--harness", f"{harness!r} is not one of {', '.join(HARNESSES)}")
    if not tasks:
        raise usage("--tasks", f"name at least one task (shipped: {', '.join(shipped_tasks()) or 'none'})")
    recipe = load_recipe(recipe_path, overrides)
    if recipe.target != "llmapi":
        raise RecipeError(
            [
                Problem(
                    str(recipe_path),
                    0,
                    0,
                    "target",
                    f"{recipe.target}: trtpipe's Triton repository has no OpenAI endpoint for lm-evaluation-harness "
                    "to score; evaluate the model as a target: llmapi recipe (--set target=llmapi), or run trtpipe "
                    "eval without --harness for the verify stage's numbers",
                )
            ]
        )
    t0 = time.perf_counter()
    # offline before anything imports huggingface_hub or datasets (both read these variables once, at import)
    saved = {k: os.environ.get(k) for k in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="trtpipe-lm-eval-") as tmp:
            includes = [shipped_include_dir(Path(tmp) / "tasks"), *[Path(p).resolve() for p in include_paths]]
            tm = task_manager(tasks, includes)
            target = resolve_openai_target(recipe_path, overrides)  # the build up to the export (cached reused)
            ref_dir = reference_dir(recipe)
            t_build, outs, t_eval = time.perf_counter() - t0, {}, {}
            for label, model_dir, name, config in (
                ("reference", ref_dir, f"{target.name}-reference", target.config),  # the same limits
                ("quantized", target.model_dir, target.name, target.config),
            ):
                echo(f"lm-eval {','.join(tasks)} on the {label}: {model_dir}")
                served = ServedModel(model_dir, name, config)
                t1 = time.perf_counter()
                outs[label] = evaluate(served, tasks, tm, limit)
                t_eval[label] = time.perf_counter() - t1
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rows = scores(outs["reference"], outs["quantized"], tasks, max_drop)
    seconds = time.perf_counter() - t0
    doc = {
        "format": RESULT_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recipe": str(recipe_path),
        "overrides": list(overrides),
        "harness": harness,
        "lm_eval": _version("lm_eval"),
        "reference": str(ref_dir),
        "quantized": str(target.model_dir),
        "limit": limit,
        "max_drop": max_drop,
        "rule": f"fail when drop > max_drop + {SE_FACTOR:g} * sqrt(se_q^2 + se_r^2)",
        "seconds": seconds,
        "seconds_build": t_build,
        "seconds_eval": t_eval,
        "answers": {t: answer_difference(outs["reference"], outs["quantized"], t) for t in tasks},
        "tasks": [{**asdict(r), "drop": r.drop} for r in rows],
    }
    out = recipe.work_path / "harness" / f"lm-eval-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    echo(render(rows))
    for task, diff in doc["answers"].items():
        echo(f"{task}: {diff['text']}")
    echo(
        f"lm-eval ran {seconds:.1f} s: build to the export {t_build:.1f} s, reference "
        f"{t_eval['reference']:.1f} s, quantized {t_eval['quantized']:.1f} s (loading, serving, scoring); result {out}"
    )
    failed = [r for r in rows if r.verdict == "FAIL"]
    if failed:
        r = failed[0]
        se = "n/a" if r.se is None else f"{r.se:.4f}"
        raise AccuracyGateError(
            f"lm-eval task {r.task}: {r.metric} delta {r.delta:+.4f} (SE {se}) drops more than --max-drop "
            f"{max_drop:g} + {SE_FACTOR:g} SE"
        )
    return doc


def _version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
