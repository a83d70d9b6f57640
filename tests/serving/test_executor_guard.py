"""executor_guard on a real executor: a loop that dies signals the server; a shutdown does not."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from trtpipe.serving.api import ExecutorConfig, Request
from trtpipe.serving.executor import Executor
from trtpipe.serving.reference_engine import ReferenceEngine
from trtpipe.triton import executor_guard

PROMPT = [1, 403, 407, 261, 378]


def _config(**kw) -> ExecutorConfig:
    return ExecutorConfig(
        **{**dict(max_num_tokens=64, max_input_len=96, max_seq_len=128, num_blocks=64, tokens_per_block=8), **kw}
    )


def _child_waiting_for_a_signal():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a stand-in server: a real process that ends on SIGUSR1's default action
        os.close(r)
        os.close(w)
        signal.pause()
        os._exit(0)
    os.close(r)
    os.close(w)
    return pid


def test_a_loop_that_dies_signals_the_server_and_says_why(model_tp1):
    pid = _child_waiting_for_a_signal()
    logged = []
    ex = Executor(_config(max_batch_size=1), executor_guard.with_fault(ReferenceEngine(model_tp1), "exit-at-step:2"))
    try:
        watcher = executor_guard.guard(ex, logged.append, server_pid=pid, sig=signal.SIGUSR1)
        done = threading.Event()
        ex.submit(Request(PROMPT, 20, streaming=True), lambda r: r.is_final and done.set())
        assert done.wait(120)
        watcher.join(60)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1
        assert (
            len(logged) == 1 and "the executor loop died: SystemExit: TRTPIPE_TWIN_FAULT: exit at step 2" in logged[0]
        )
    finally:
        ex.shutdown()


def test_a_shutdown_leaves_the_server_alone(model_tp1):
    pid = _child_waiting_for_a_signal()
    logged = []
    try:
        ex = Executor(_config(max_batch_size=1), ReferenceEngine(model_tp1))
        watcher = executor_guard.guard(ex, logged.append, server_pid=pid, sig=signal.SIGUSR1)
        ex.shutdown()
        watcher.join(60)
        assert not watcher.is_alive() and not logged
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still running
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("spec", ["exit-at-step", "exit-at-step:x", "crash:3"])
def test_a_bad_fault_spec_is_named(spec):
    with pytest.raises(ValueError, match=f"TRTPIPE_TWIN_FAULT={spec!r}: expected exit-at-step:N"):
        executor_guard.with_fault(object(), spec)
