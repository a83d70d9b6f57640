"""Project-wide test settings: deterministic seeds, and the path of the tiny model shipped in models/."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

# Tiny models run ~20x slower with several OpenMP threads on a busy 2-core machine; tritonserver's python
# stubs started by the tests inherit this too.
# TRTPIPE_TEST_THREADS=2 runs the suite's torch code with 2 threads (tests/numerics.py: results must not depend on it).
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("TRTPIPE_TEST_THREADS", "1"))

REPO_ROOT = Path(__file__).resolve().parents[1]
STORIES = REPO_ROOT / "models" / "stories260k"  # the tiny trained Llama (MIT), models/stories260k/SOURCE.md


# The fast tier (`make test-fast`: `pytest -m "not slow"`) holds no test that starts a server or an MPI job, compares
# against ModelOpt, kills processes, needs a GPU or runs trtpipe in a child process: such a test is `slow` whether
# or not its file says so (marks and fixtures below); tests measured at seconds each carry `slow` themselves.
HEAVY_MARKS = ("triton", "mpi", "oracle", "chaos", "gpu")
SLOW_FIXTURES = frozenset(
    {
        "server",  # a tritonserver or an OpenAI twin for the module
        "driver",  # trtpipe with the test stages in a child process (tests/pipeline/conftest.py)
        "run_mpi",  # mpiexec (tests/serving/mpi/conftest.py)
        "drill",  # the Dynamo frontend and workers (tests/serving/test_dynamo.py)
        "made",  # MoE W4A16 checkpoints made in the producers' venv (tests/imported/test_moe_int4_import.py)
    }
)


def heavy(item: pytest.Item) -> bool:
    """Whether the fast tier leaves this test out by what it uses, whatever its own marks."""
    return any(item.get_closest_marker(m) for m in HEAVY_MARKS) or not SLOW_FIXTURES.isdisjoint(
        getattr(item, "fixturenames", ())
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if heavy(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.fail(f"the tiny model is missing: {STORIES}")
    return STORIES


@pytest.fixture(scope="session")
def stories_fp16_export(tmp_path_factory, stories_dir) -> Path:
    """stories260k exported float16 by the llmapi export (no quantization): what the OpenAI twin, the batch
    client, the Dynamo workers and the monitoring end-to-end test serve (built once per session)."""
    from openai_helpers import fp16_export

    return fp16_export(stories_dir, tmp_path_factory.mktemp("fp16_export"))
