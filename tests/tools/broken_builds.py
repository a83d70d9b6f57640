#!/usr/bin/env python3
"""Each test that guards a named bug must fail when that bug is put back: break the build, run the test, restore.

    python tests/tools/broken_builds.py [--list] [NAME ...]

For every case below the script replaces one exact snippet of the product with the bug (the snippet must occur
exactly once, so a case that no longer applies says so instead of passing), runs the tests that are meant to catch
it and expects them to FAIL, then restores the file and expects the same tests to PASS. Prints one line per case
and exits non-zero if any case's tests passed on the broken build or failed on the real one.

Run it from a checkout with the venv of ``make install`` (``.venv/bin/python tests/tools/broken_builds.py``). The
serving cases start a real tritonserver (a minute or two each); ``NAME ...`` runs a subset.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    bug: str  # what the broken build does, in words
    path: str  # the product file the bug goes into
    good: str  # the snippet as it is
    bad: str  # the snippet with the bug
    tests: tuple[str, ...]  # pytest arguments that must fail on the broken build


CASES = (
    Case(
        "stop-request",
        "stop=true cancels nothing (the request ends by itself only after its 251 tokens)",
        "model_repo/tensorrt_llm/1/model.py",
        "                if owner == tid:\n                    self.executor.cancel(rid)",
        "                if owner == tid:\n                    pass",
        ("tests/triton_serving/test_inflight.py", "-k", "stop_request"),
    ),
    Case(
        "executor-seed",
        "the executor seeds every sampled request with 0, whatever its seed",
        "trtpipe/serving/executor.py",
        "manual_seed(int(req.sampling.seed))",
        "manual_seed(0)",
        ("tests/serving/test_executor.py", "-k", "seeded"),
    ),
    Case(
        "generate-seed",
        "generate() seeds row i with i, whatever the seed",
        "trtpipe/runtime/generate.py",
        "manual_seed(int(seed) + i)",
        "manual_seed(i)",
        ("tests/runtime/test_generate.py", "-k", "seed"),
    ),
    Case(
        "poisson-seed",
        "the Poisson arrivals ignore their seed",
        "trtpipe/perf/simulate.py",
        "rng = random.Random(seed)",
        "rng = random.Random(0)",
        ("tests/perf/test_simulate.py", "-k", "poisson"),
    ),
    Case(
        "percentile",
        "percentiles by the 'lower' rule instead of linear interpolation",
        "trtpipe/bench/metrics.py",
        "np.percentile(a, p))",
        'np.percentile(a, p, method="lower"))',
        ("tests/bench/test_metrics.py", "-k", "stats_by_hand or closest_ranks"),
    ),
    Case(
        "tokenizer-dir",
        "tokenizer_dir left relative to the model (upstream's models resolve it against tritonserver's "
        "working directory)",
        "trtpipe/triton/repo.py",
        "    point_tokenizer_dirs(configs, tokenizer_dir)\n",
        "    pass\n",
        ("tests/triton_serving/test_repo.py", "-k", "upstream_models_load_the_tokenizer"),
    ),
    Case(
        "plan-unknown-gpu",
        "plan --slo --gpus with an unknown GPU answers 'does not fit' and exits 0",
        "trtpipe/app/predictor.py",
        "    for key in gpus or ():  # a typo is bad input",
        "    for key in ():  # a typo is bad input",
        ("tests/perf/test_predict_plan_cli.py", "-k", "unknown_gpu"),
    ),
    Case(
        "step-fit-huber",
        "the step-cost fit drops its Huber weights (plain least squares: stalls drag it)",
        "trtpipe/perf/step_fit.py",
        "w = np.sqrt(np.minimum(1.0, HUBER_K * sigma / np.maximum(np.abs(r), 1e-12)))",
        "w = np.ones_like(y)",
        ("tests/perf/test_step_fit.py", "-k", "stalls"),
    ),
    Case(
        "bad-seed-kills-executor",
        "a seed torch cannot take is admitted unchecked (it killed the executor thread)",
        "trtpipe/serving/executor.py",
        "        sampling = req.sampling.problem()\n",
        "        sampling = None\n",
        ("tests/serving/test_executor.py", "-k", "bad_sampling"),
    ),
    Case(
        "import-cycle",
        "a function-local import that closes a cycle (processes -> mpi_launch -> processes)",
        "trtpipe/processes.py",
        "\n\ndef remove_files(",
        "\n\ndef _cycle():\n    from trtpipe.triton import mpi_launch  # noqa: F401\n\n\ndef remove_files(",
        ("tests/test_architecture.py", "-k", "no_import_cycles"),
    ),
)


def run_tests(args: tuple[str, ...]) -> bool:
    """True when the tests pass (pytest exit 0); 5 (nothing collected) counts as a broken case, not a pass."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode == 5:
        raise RuntimeError(f"no test selected by {' '.join(args)}")
    return proc.returncode == 0


def check(case: Case) -> str:
    path = ROOT / case.path
    text = path.read_text()
    if text.count(case.good) != 1:
        return f"STALE  {case.name}: the snippet occurs {text.count(case.good)} times in {case.path}"
    try:
        path.write_text(text.replace(case.good, case.bad))
        caught = not run_tests(case.tests)
    finally:
        path.write_text(text)
    passes = run_tests(case.tests)
    verdict = "ok    " if caught and passes else "FAILED"
    return (
        f"{verdict} {case.name}: broken build {'fails' if caught else 'PASSES'}, real build "
        f"{'passes' if passes else 'FAILS'} ({' '.join(case.tests)}) -- {case.bug}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="cases to run (default: all)")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    cases = [c for c in CASES if not a.names or c.name in a.names]
    if a.list or not cases:
        print("\n".join(f"{c.name}: {c.bug}" for c in CASES))
        return 0 if a.list else 2
    lines = []
    for c in cases:
        lines.append(check(c))
        print(lines[-1], flush=True)
    return 0 if all(line.startswith("ok") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
