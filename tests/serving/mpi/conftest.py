"""Fixtures of the multi-process tests: the venv's MPICH ``mpiexec`` (the one mpi4py loads) and stories260k
checkpoints in several tp x pp layouts (converted once per session)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def mpiexec() -> str:
    path = Path(sys.executable).parent / "mpiexec"
    if not path.exists():
        pytest.skip(f"{path}: the venv has no mpiexec: pip install 'trtpipe[mpi]'")
    return str(path)


@pytest.fixture(scope="session")
def stories_ckpt(tmp_path_factory, stories_dir):
    """(tp, pp) -> a float16 TRT-LLM checkpoint of stories260k in that layout."""
    from trtpipe.checkpoint.convert import convert

    made: dict = {}

    def make(tp: int, pp: int = 1) -> Path:
        if (tp, pp) not in made:
            made[tp, pp] = convert(
                stories_dir, tmp_path_factory.mktemp(f"ckpt_tp{tp}pp{pp}") / "ckpt", tp=tp, pp=pp, dtype="float16"
            )
        return made[tp, pp]

    return make


@pytest.fixture(scope="session")
def run_mpi(mpiexec):
    """(n, script, *args) -> ``mpiexec -n N python tests/serving/mpi/SCRIPT ARGS`` with a hard timeout (a hung
    collective must fail the test, not hang it)."""

    def run(n: int, script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [mpiexec, "-n", str(n), sys.executable, str(HERE / script), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
