"""The one process supervisor (``trtpipe.processes.spawn``, ``trtpipe.supervisor``): real child processes, a
second each at most: a readiness probe over HTTP, a start-up that fails or times out, dying with the parent, the
state file, a teardown of a process that ignores SIGTERM, and shared-memory clean-up that never takes others'."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trtpipe import supervisor as S
from trtpipe.processes import SHM_DIR, clean_shm, pid_alive, spawn, write_state

HTTP = [
    sys.executable,
    "-c",
    "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), "
    "type('H', (http.server.BaseHTTPRequestHandler,), {'do_GET': lambda s: (s.send_response(200), "
    "s.end_headers()), 'log_message': lambda *a: None})).serve_forever()",
]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTPIPE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_started_server_is_probed_ready_recorded_and_torn_down(cache):
    port = S.free_ports(1)[0]
    server = S.start(
        [*HTTP, str(port)], cache / "http.log", cache, "127.0.0.1", S.Ports(port, 0, 0), "openai", "trtpipe-test{pid}_"
    )
    assert server.shm_prefix == f"trtpipe-test{server.pid}_" and os.getpgid(server.pid) == server.pid  # own group
    assert S.await_ready(server, 30) is None and server.ready()
    state = S.state_path(cache)
    server.detach(state)
    assert [s.pid for s in S.detached_servers()] == [server.pid] and S.load_state(state).kind == "openai"
    with pytest.raises(Exception, match="already served"):
        S.refuse_if_served(cache)
    server.stop()
    assert not pid_alive(server.pid) and not state.exists() and S.detached_servers() == []


def test_a_server_that_exits_or_never_answers_is_named_and_stopped(cache):
    dead = S.start(
        [sys.executable, "-c", "raise SystemExit(3)"],
        cache / "dead.log",
        cache,
        "127.0.0.1",
        S.Ports(S.free_ports(1)[0], 0, 0),
        "openai",
    )
    assert S.await_ready(dead, 30) == "exited during start-up" and dead.process.returncode == 3
    mute = S.start(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        cache / "mute.log",
        cache,
        "127.0.0.1",
        S.Ports(S.free_ports(1)[0], 0, 0),
        "openai",
    )
    assert S.await_ready(mute, 0.5) == "not ready after 0 s" and not mute.alive()


def test_teardown_kills_the_process_group_when_sigterm_is_ignored(tmp_path):
    # the leader ignores SIGTERM and has a child in its group: after the grace both get SIGKILL
    code = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); "
        "time.sleep(60)"
    )
    server = S.start(
        [sys.executable, "-u", "-c", code],
        tmp_path / "group.log",
        tmp_path,
        "127.0.0.1",
        S.Ports(S.free_ports(1)[0], 0, 0),
        "openai",
    )
    deadline = time.monotonic() + 30
    while not (tmp_path / "group.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int((tmp_path / "group.log").read_text().split()[0])
    server.stop(timeout=0.5)
    assert server.process.returncode == -9
    deadline = time.monotonic() + 10
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(grandchild)


def test_a_child_spawned_to_die_with_its_parent_does(tmp_path):
    # the parent spawns a sleeper that dies with it, prints its pid, and is SIGKILLed: the sleeper must end too
    code = (
        "import sys; from trtpipe.processes import spawn; "
        "c = spawn([sys.executable, '-c', 'import time; time.sleep(60)'], None, die_with_parent=True); "
        "print(c.pid, flush=True); import time; time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    child = int(parent.stdout.readline())
    assert pid_alive(child)
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child)


def test_spawn_writes_the_log_and_its_header(tmp_path):
    log = tmp_path / "x.log"
    child = spawn([sys.executable, "-c", "print('hello')"], log, header=True)
    assert child.wait(30) == 0
    lines = log.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == "hello"


def test_an_empty_shm_prefix_removes_nothing():
    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm")
    mine = SHM_DIR / f"trtpipe-test-{os.getpid()}"
    mine.write_bytes(b"x")
    try:
        assert clean_shm("") == [] and mine.exists()  # a server without a prefix must not take every region
        assert clean_shm(mine.name) == [mine.name] and not mine.exists()
    finally:
        mine.unlink(missing_ok=True)


def test_a_group_notices_each_end_once_and_stops_in_order(tmp_path):
    # two "workers" (one ignores SIGTERM) and a "frontend": workers stop first, the deaf one by SIGKILL after the grace
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    quick = S.spawn_member("worker0", [sys.executable, "-c", "raise SystemExit(2)"], tmp_path / "w0.log")
    workers = [quick, S.spawn_member("worker1", deaf, tmp_path / "w1.log")]
    frontend = S.spawn_member("frontend", sleep, tmp_path / "f.log")
    assert quick.proc.wait(30) == 2
    assert quick.notice_end() and quick.cause == "exited with status 2" and not quick.notice_end()
    assert (tmp_path / "w1.log").read_text().startswith("# ")  # its command line heads its log
    time.sleep(0.5)  # let the deaf one install its handler
    S.stop_in_order((workers, [frontend]), grace=0.5)
    assert [m.notice_end() for m in (*workers, frontend)] == [False, True, True]
    assert (workers[1].cause, frontend.cause) == ("Killed (signal 9, SIGKILL)", "Killed (signal 15, SIGTERM)")


@pytest.mark.parametrize("recorded", ["an hour earlier", "not recorded (an older trtpipe's file)"])
def test_stop_never_signals_a_process_that_reuses_a_dead_servers_pid(cache, recorded):
    # a detached server's state file whose pid now belongs to another process (the server died, the pid was reused)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        region = SHM_DIR / f"trtpipe-test{stranger.pid}_region"
        if SHM_DIR.is_dir():
            region.write_bytes(b"x")  # the stranger's region, named like the dead server's prefix
        state = S.state_path(cache)
        state.parent.mkdir(parents=True)
        started = psutil.Process(stranger.pid).create_time()
        record = {
            "pid": stranger.pid,
            "started": started - 3600.0,  # the recorded server started an hour before the stranger
            "cmdline": ["tritonserver", "--model-repository", str(cache)],
            "repo": str(cache),
            "bind": "127.0.0.1",
            "log": str(cache / "x.log"),
            "shm_prefix": f"trtpipe-test{stranger.pid}_",
            "state_file": str(state),
            "kind": "openai",
            "ports": {"http": 9, "grpc": 0, "metrics": 0},
        }
        if recorded != "an hour earlier":
            del record["started"], record["cmdline"]
        write_state(state, record)
        assert not S.load_state(state).alive()
        S.load_state(state).stop(timeout=0.5)
        assert stranger.poll() is None and pid_alive(stranger.pid)  # not signalled
        assert not SHM_DIR.is_dir() or region.exists()  # nor its regions removed
        write_state(state, record)
        assert S.detached_servers() == [] and not state.exists()  # a stale record, dropped
        assert stranger.poll() is None and (not SHM_DIR.is_dir() or region.exists())
    finally:
        stranger.kill()
        stranger.wait(10)
        if SHM_DIR.is_dir():
            (SHM_DIR / f"trtpipe-test{stranger.pid}_region").unlink(missing_ok=True)


def test_a_detached_server_records_its_start_time_and_command_line_and_stop_finds_it(cache):
    port = S.free_ports(1)[0]
    cmd = [*HTTP, str(port)]
    server = S.start(cmd, cache / "http.log", cache, "127.0.0.1", S.Ports(port, 0, 0), "openai")
    try:
        assert S.await_ready(server, 30) is None
        state = S.state_path(cache)
        server.detach(state)
        found = S.load_state(state)
        assert found.started == psutil.Process(server.pid).create_time() and found.cmdline == cmd
        assert found.process is None and found.alive()
        found.stop()  # through the state file alone, as trtpipe stop does
        assert server.process.wait(10) is not None and not state.exists()
    finally:
        server.stop()
