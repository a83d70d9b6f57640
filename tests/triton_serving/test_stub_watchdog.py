"""The stub watchdog with real processes: a "server" process, its "stub" child stuck in a C call that holds the
GIL (as a python-backend send to a dead tritonserver does), and the watchdog the stub starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from trtpipe.triton.stub_watchdog import GRACE_S

# the stub: start a watchdog (the real one, or one running ``how`` directly), report pids, then hold the GIL
STUB = """
import ctypes, os, subprocess, sys
how, life = sys.argv[1], float(sys.argv[2])
if how == "start":
    from trtpipe.triton import stub_watchdog
    dog = stub_watchdog.start()
else:  # the same watch, run by a given function of the module
    code = ("import sys; from trtpipe.triton import stub_watchdog as w; "
            f"w.{how}(int(sys.argv[1]), int(sys.argv[2]))")
    dog = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), str(os.getppid())])
print(os.getpid(), dog.pid, flush=True)
if life > 0:
    ctypes.PyDLL(None).usleep(int(life * 1e6))  # PyDLL: the GIL stays held for the whole call
    os._exit(0)
ctypes.PyDLL(None).pause()  # blocked for good, GIL held: no Python thread of this process runs again
"""

# the server: start the stub, pass its line on, wait to be killed
SERVER = """
import subprocess, sys, time
stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stdout=subprocess.PIPE, text=True)
print(stub.stdout.readline().strip(), flush=True)
stub.wait()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids, timeout: float) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - start > timeout:
            return float("inf")
        time.sleep(0.01)
    return time.monotonic() - start


def _start(how: str, life: float):
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, STUB, how, str(life)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    stub, dog = (int(x) for x in server.stdout.readline().split())
    return server, stub, dog


@pytest.mark.slow
@pytest.mark.parametrize("how", ["start", "watch", "_watch_by_polling"])
def test_a_stub_holding_the_gil_dies_with_its_server(how):
    server, stub, dog = _start(how, life=0)
    try:
        time.sleep(0.3)  # the stub is inside its GIL-holding call
        assert _alive(stub) and _alive(dog)
        server.kill()
        server.wait()
        took = _wait_gone([stub, dog], timeout=GRACE_S + 5)
        print(f"{how}: stub and watchdog gone {took:.3f} s after the server's kill -9")
        assert GRACE_S - 0.5 < took < GRACE_S + 5, "the stub must get its grace period, then go"
    finally:
        for pid in (stub, dog):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["start", "_watch_by_polling"])
def test_the_watchdog_ends_with_a_stub_that_exits_and_leaves_the_server_alone(how):
    server, stub, dog = _start(how, life=0.3)
    try:
        assert _wait_gone([stub, dog], timeout=5) < 5
        assert server.poll() is None  # nobody touched the server
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_only_the_stubs_own_child_watches():
    """Started by anyone but the stub, the watchdog refuses (it could not trust the stub's pid)."""
    res = subprocess.run(
        [sys.executable, "-m", "trtpipe.triton.stub_watchdog", "1", str(os.getpid())], capture_output=True, timeout=30
    )
    assert res.returncode == 2
