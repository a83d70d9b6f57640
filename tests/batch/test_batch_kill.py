"""``trtpipe batch`` killed with ``kill -9`` and resumed, against the real OpenAI twin over HTTP on 127.0.0.1.

The kill points are states, not times: the client is killed once the output holds N lines, and a torn last line
(what a kill inside a write leaves) is put there by the test, so every run goes through the same recovery. Checked
as ``scripts/batch_kill_drill.py`` checks its 2,000-request job: each custom_id exactly once across the output and
errors files, and each greedy answer equal to an uninterrupted run's. Also: a recipe (here an HF directory) served
by the job itself is started again when it dies and dies with the job, and a server refusing with 429 (queue
full) slows the job without loss."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai_helpers import serve_in_thread
from optional import needs

pytestmark = [pytest.mark.slow, pytest.mark.chaos, needs("aiohttp")]

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 300  # upper bound of any wait below (a loaded machine); never what a test measures


def _drill():
    spec = importlib.util.spec_from_file_location("batch_kill_drill", REPO / "scripts" / "batch_kill_drill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


drill = _drill()


@pytest.fixture(scope="module")
def export(stories_fp16_export):
    return stories_fp16_export


@pytest.fixture(scope="module")
def url(export):
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    with serve_in_thread(OpenAIServer(ServedModel(export, "stories-batch")).app) as base:
        yield base


@pytest.fixture(scope="module")
def reference(tmp_path_factory, url):
    """200 requests (one invalid), run once uninterrupted."""
    root = tmp_path_factory.mktemp("reference")
    req = root / "requests.jsonl"
    drill.write_requests(req, 200, 8)
    r = subprocess.run(
        cmd(url, req, root / "ref.jsonl"), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S
    )
    assert r.returncode == 3, r.stderr[-2000:]  # completed, with the one invalid request in the errors file
    return req, root / "ref.jsonl", root / "ref.errors.jsonl"


ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def cmd(target: str, req: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trtpipe.cli",
        "batch",
        target,
        "-i",
        str(req),
        "-o",
        str(out),
        "-c",
        "8",
        "--no-progress",
        *extra,
    ]


def kill_at(proc: subprocess.Popen, out: Path, lines: int) -> None:
    """kill -9 ``proc`` once ``out`` holds ``lines`` lines."""
    wait_for(f"line {lines}", lambda: drill.count_lines(out) >= lines, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(WAIT_S)


def test_killed_twice_then_resumed_writes_each_custom_id_once_with_the_uninterrupted_answers(tmp_path, url, reference):
    req, ref_out, ref_err = reference
    out, err = tmp_path / "results.jsonl", tmp_path / "results.errors.jsonl"
    kill_at(subprocess.Popen(cmd(url, req, out), env=ENV, cwd=REPO, stderr=subprocess.DEVNULL), out, 50)
    done = {json.loads(x)["custom_id"] for x in out.read_text().splitlines()}
    state = json.loads((tmp_path / "results.jsonl.state.json").read_text())  # whole JSON: written atomically
    assert state["status"] == "running" and state["succeeded"] <= len(done)
    torn = next(x for x in ref_out.read_bytes().splitlines(keepends=True) if json.loads(x)["custom_id"] not in done)
    with open(out, "ab") as f:  # a kill inside a write: the first part of a line, no newline
        f.write(torn[: len(torn) // 2])
    second = subprocess.Popen(cmd(url, req, out), env=ENV, cwd=REPO, stderr=subprocess.PIPE, text=True)
    kill_at(second, out, 120)
    assert "recovered a torn last line" in second.stderr.read()
    last = subprocess.run(cmd(url, req, out), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert last.returncode == 3, last.stderr[-2000:]
    assert last.stdout.startswith("batch completed: 200 of 200 requests written (199 succeeded, 1 failed)")
    result = drill.check(req, out, err, ref_out, ref_err)
    assert {
        k: result[k]
        for k in ("lines_written", "succeeded", "failed", "duplicates", "missing", "extra", "answers_differing")
    } == {
        "lines_written": 200,
        "succeeded": 199,
        "failed": 1,
        "duplicates": 0,
        "missing": 0,
        "extra": 0,
        "answers_differing": 0,
    }
    state = json.loads((tmp_path / "results.jsonl.state.json").read_text())
    assert (state["status"], state["runs"], state["succeeded"], state["failed"]) == ("completed", 3, 199, 1)
    again = subprocess.run(cmd(url, req, out), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert again.returncode == 3 and "this run 0 in" in again.stdout  # nothing left: nothing sent
    assert drill.count_lines(out) == 199


def test_retry_errors_sends_the_fixed_failed_request_again_and_keeps_its_first_answer(tmp_path, url, reference):
    req, ref_out, ref_err = reference
    out, err = tmp_path / "results.jsonl", tmp_path / "results.errors.jsonl"
    out.write_bytes(ref_out.read_bytes())
    err.write_bytes(ref_err.read_bytes())
    (bad,) = [json.loads(x)["custom_id"] for x in err.read_text().splitlines()]
    fixed = tmp_path / "requests.jsonl"  # the user corrects the request that failed (max_tokens -1), same custom_id
    lines = [json.loads(x) for x in req.read_text().splitlines()]
    for line in lines:
        if line["custom_id"] == bad:
            line["body"]["max_tokens"] = 8
    fixed.write_text("".join(json.dumps(x) + "\n" for x in lines))
    plain = subprocess.run(cmd(url, fixed, out), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    assert plain.returncode == 3 and "this run 0 in" in plain.stdout  # without the flag a failure stays done
    r = subprocess.run(
        cmd(url, fixed, out, "--retry-errors"), env=ENV, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("batch completed: 200 of 200 requests written (200 succeeded, 0 failed)")
    assert "retrying 1 failed requests" in r.stderr and "retried 1 failed requests" in r.stdout
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 200 and ids[-1] == bad and err.read_text() == ""
    assert (tmp_path / "results.errors.retried-1.jsonl").read_bytes() == ref_err.read_bytes()
    assert json.loads(out.read_text().splitlines()[-1])["response"]["status_code"] == 200


def wait_for(what: str, ok, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_served_target_is_revived_dies_with_its_job_and_the_rerun_serves_it_again(tmp_path, export, reference):
    import psutil

    req, ref_out, ref_err = reference
    small = tmp_path / "requests.jsonl"
    small.write_text("".join(req.read_text().splitlines(keepends=True)[:40]))
    out = tmp_path / "results.jsonl"
    env = {**ENV, "TRTPIPE_CACHE": str(tmp_path / "cache")}
    job = subprocess.Popen(cmd(str(export), small, out), env=env, cwd=REPO, stderr=subprocess.DEVNULL)
    wait_for("line 5", lambda: drill.count_lines(out) >= 5, job)
    first = psutil.Process(job.pid).children()
    assert [" ".join(s.cmdline()[2:5]) for s in first] == [f"trtpipe.cli serve {export}"]
    first[0].kill()  # the job's server dies: the job starts it again and goes on
    wait_for(
        "a second server", lambda: [c.pid for c in psutil.Process(job.pid).children()] not in ([], [first[0].pid]), job
    )
    mark = drill.count_lines(out) + 5
    wait_for(f"line {mark}", lambda: drill.count_lines(out) >= mark, job)
    second = psutil.Process(job.pid).children()
    os.kill(job.pid, signal.SIGKILL)
    job.wait(WAIT_S)
    gone, alive = psutil.wait_procs(second, timeout=WAIT_S)
    assert not alive  # PR_SET_PDEATHSIG: the job's own server does not outlive it
    last = subprocess.run(
        cmd(str(export), small, out), env=env, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S
    )
    assert last.returncode == 3 and "batch completed: 40 of 40" in last.stdout, last.stderr[-2000:]
    result = drill.check(small, out, tmp_path / "results.errors.jsonl", ref_out, ref_err)
    assert (result["lines_written"], result["duplicates"], result["missing"], result["answers_differing"]) == (
        40,
        0,
        0,
        0,
    )


def test_queue_full_429s_slow_the_job_and_lose_nothing(tmp_path, export):
    """One batch slot and a queue of one: the twin answers 429 to what does not fit (QueueFullError)."""
    from trtpipe.batch.client import BatchClient, ClientOptions
    from trtpipe.batch.journal import Journal, default_errors_path, default_state_path
    from trtpipe.batch.requests import read_requests
    from trtpipe.serving.config import twin_default
    from trtpipe.serving.openai_server import OpenAIServer, ServedModel

    max_pos = json.loads((export / "config.json").read_text())["max_position_embeddings"]
    config = dataclasses.replace(twin_default(max_pos, max_batch_size=1), max_queue_size=1)
    req, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    drill.write_requests(req, 40, 8)
    requests = read_requests(req)
    with serve_in_thread(OpenAIServer(ServedModel(export, "stories-429", config)).app) as base:
        journal = Journal(req, out, default_errors_path(out), default_state_path(out), base)
        journal.open(requests)
        client = BatchClient(base, journal, ClientOptions(concurrency=6, metrics_interval_s=0), lambda ok: None, print)
        try:
            stats = asyncio.run(client.run(requests))
        finally:
            journal.close()
    print(f"429 answers {stats.overloaded}, window halvings {client.window.decreases}, sent {stats.sent}")
    assert (journal.succeeded, journal.failed) == (39, 1)  # the invalid one (max_tokens -1) is the request's fault
    assert stats.sent == 40 + stats.overloaded + stats.retried
    assert stats.overloaded == 0 or client.window.decreases >= 1
    assert len({json.loads(x)["custom_id"] for x in out.read_text().splitlines()}) == 39
