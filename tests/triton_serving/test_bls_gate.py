"""The BLS's request gate (``_IteratorGate`` in model_repo/tensorrt_llm_bls/1/model.py) when a response iterator
never ends, as the python backend of tritonserver 2.51 leaves one whose error final it lost (issue 38 item 2; the
real-server test is ``test_bls_failures.py``). The iterators here are plain Python ones that block as the stub's
``next()`` does; the module is loaded with tritonserver's own ``triton_python_backend_utils``. Waits have limits
only to turn a hang into a failure."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

pytriton = pytest.importorskip("pytriton", reason="pip install 'trtpipe[serve]'")

MODEL = Path(__file__).resolve().parents[2] / "model_repo" / "tensorrt_llm_bls" / "1" / "model.py"
HANG_S = 30.0


@pytest.fixture(scope="module")
def bls():
    sys.path.insert(0, str(Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"))
    try:
        spec = importlib.util.spec_from_file_location("bls_model_under_test", MODEL)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def _never_ending(first=()):
    """An iterator that yields ``first`` and then blocks forever in next(), as one whose final was lost."""
    yield from first
    threading.Event().wait()


class _Call:
    """What the gate calls ``exec(decoupled=True)`` on: returns ``result`` (or blocks until ``release`` is set)."""

    def __init__(self, result=None, release=None):
        self.result, self.release = result, release

    def exec(self, decoupled):
        assert decoupled
        if self.release is not None:
            self.release.wait()
        return self.result


def _in_thread(fn):
    out, done = [], threading.Event()

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return out, done


def test_a_stream_past_its_deadline_ends_with_lost_and_new_calls_still_get_in(bls):
    gate = bls._IteratorGate()
    gate.PATIENCE_S = 0.2
    stream = gate.responses(_never_ending(["token"]), deadline=time.monotonic() + 0.5)
    assert next(stream) == "token"
    out, done = _in_thread(lambda: next(stream))
    assert done.wait(HANG_S), "the consumer waited past its deadline"
    assert isinstance(out[0], bls._Lost)
    # its reader is still inside next(), for good: a new call must not wait for it
    out, done = _in_thread(lambda: gate.call(_Call("answer")))
    assert done.wait(HANG_S) and out == ["answer"], "a lost final kept a new call out of the gate"


def test_an_ended_stream_yields_everything_and_lets_calls_in(bls):
    gate = bls._IteratorGate()
    assert list(gate.responses(iter(["a", "b", "c"]), deadline=None)) == ["a", "b", "c"]
    out, done = _in_thread(lambda: gate.call(_Call("answer")))
    assert done.wait(HANG_S) and out == ["answer"]


def test_a_call_stuck_past_the_deadline_reports_it(bls):
    stuck, release = threading.Event(), threading.Event()
    gate = bls._IteratorGate(stuck_s=0.5, on_stuck=lambda seconds: stuck.set())
    _in_thread(lambda: gate.call(_Call(release=release)))
    try:
        assert stuck.wait(HANG_S), "a call stuck in exec() was not reported"
    finally:
        release.set()


def test_a_call_that_returns_is_not_reported(bls):
    stuck = threading.Event()
    gate = bls._IteratorGate(stuck_s=0.5, on_stuck=lambda seconds: stuck.set())
    for _ in range(3):
        assert gate.call(_Call("answer")) == "answer"
    assert not stuck.wait(2.0)  # the watch runs every second: two looks at an empty gate
