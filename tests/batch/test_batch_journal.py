"""The batch journal: a torn last line is cut back to the last newline (and only it), lines that are not this
job's are refused by file:line, a second job on the same output is refused, the state file is whole JSON."""

from __future__ import annotations

import json
import os

import pytest

from trtpipe.batch.client import result_line
from trtpipe.batch.journal import Journal, default_errors_path, default_state_path, recover
from trtpipe.batch.requests import BatchError, BatchRequest


def reqs(*ids: str) -> list[BatchRequest]:
    return [BatchRequest(i + 1, c, "/v1/completions", {"prompt": "x"}) for i, c in enumerate(ids)]


def rec(cid: str) -> bytes:
    return (json.dumps(result_line(cid, 200, "cmpl-1", {"choices": [{"text": "hi"}]})) + "\n").encode()


def journal(tmp_path, ids=("a", "b", "c")) -> Journal:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": c}) + "\n" for c in ids))
    out = tmp_path / "out.jsonl"
    return Journal(inp, out, default_errors_path(out), default_state_path(out), "http://127.0.0.1:9")


def test_default_paths(tmp_path):
    assert default_errors_path(tmp_path / "results.jsonl") == tmp_path / "results.errors.jsonl"
    assert default_state_path(tmp_path / "results.jsonl") == tmp_path / "results.jsonl.state.json"


def test_torn_last_line_is_cut_and_its_request_is_pending(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = rec("a") + rec("b")
    out.write_bytes(whole + rec("c")[:17])  # killed inside the write of c's line
    r = recover(out)
    assert r.ids == {"a": 1, "b": 2} and r.torn_bytes == 17
    assert out.read_bytes() == whole
    assert recover(out).torn_bytes == 0  # nothing more to cut


def test_a_line_that_is_not_a_result_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    text = rec("a") + b"hello\n" + rec("b")
    out.write_bytes(text)
    with pytest.raises(BatchError, match=r"out.jsonl:2: not a batch result line"):
        recover(out)
    assert out.read_bytes() == text  # untouched


def test_an_id_written_twice_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_bytes(rec("a") + rec("b") + rec("a"))
    with pytest.raises(BatchError, match=r"out.jsonl:3: custom_id 'a' written twice \(first on line 1\)"):
        recover(out)


def test_open_returns_done_ids_of_both_files_and_appends_whole_lines(tmp_path):
    j = journal(tmp_path)
    j.output.write_bytes(rec("a"))
    b = rec("b")
    j.errors.write_bytes(b + rec("c")[:5])
    assert j.open(reqs("a", "b", "c")) == {"a", "b"}
    assert j.torn == [f"{j.errors}: 5 bytes"] and (j.succeeded, j.failed) == (1, 1)
    j.append(result_line("c", 200, "r", {"x": 1}), failed=False)
    j.close()
    assert [json.loads(x)["custom_id"] for x in j.output.read_text().splitlines()] == ["a", "c"]
    assert j.errors.read_bytes() == b


def test_ids_foreign_to_the_input_or_in_both_files_are_refused(tmp_path):
    j = journal(tmp_path)
    j.output.write_bytes(rec("a") + rec("zzz"))
    with pytest.raises(BatchError, match=r"out.jsonl:2: custom_id 'zzz' is not in .*in.jsonl"):
        j.open(reqs("a", "b", "c"))
    j.output.write_bytes(rec("a"))
    j.errors.write_bytes(rec("a"))
    with pytest.raises(BatchError, match=r"out.errors.jsonl:1: custom_id 'a' is also in .*out.jsonl \(line 1\)"):
        j.open(reqs("a", "b", "c"))


def test_a_second_job_on_the_same_output_is_refused(tmp_path):
    first, second = journal(tmp_path), journal(tmp_path)
    first.open(reqs("a", "b", "c"))
    try:
        with pytest.raises(BatchError, match="another trtpipe batch is writing this output"):
            second.open(reqs("a", "b", "c"))
    finally:
        first.close()
    second.open(reqs("a", "b", "c"))  # the lock went with the first job
    second.close()


def test_state_file_counts_and_runs(tmp_path):
    j = journal(tmp_path)
    j.open(reqs("a", "b", "c"))
    j.append(result_line("a", 200, "r", {}), failed=False)
    j.append(result_line("b", None, "", None, {"code": "timeout", "message": "m"}), failed=True)
    j.checkpoint("running")
    j.close()
    s = json.loads(j.state.read_text())
    assert (s["status"], s["total"], s["succeeded"], s["failed"], s["pending"], s["runs"]) == ("running", 3, 1, 1, 1, 1)
    assert s["output_bytes"] == j.output.stat().st_size and len(s["input_sha256"]) == 64
    again = journal(tmp_path)
    assert again.open(reqs("a", "b", "c")) == {"a", "b"}
    again.close()
    assert json.loads(again.state.read_text())["runs"] == 2
    assert not list(tmp_path.glob(".tmp-*"))  # the atomic writes left no temporary file


def test_retry_errors_archives_the_errors_file_and_makes_its_requests_pending(tmp_path):
    j = journal(tmp_path)
    j.output.write_bytes(rec("a"))
    failed = rec("b") + rec("c")
    j.errors.write_bytes(failed)
    assert j.open(reqs("a", "b", "c"), retry_errors=True) == {"a"}
    assert (j.retried, j.retried_from, j.failed) == (2, tmp_path / "out.errors.retried-1.jsonl", 0)
    assert j.retried_from.read_bytes() == failed and j.errors.read_bytes() == b""  # kept, not overwritten
    j.append(result_line("b", None, "", None, {"code": "timeout", "message": "m"}), failed=True)
    j.close()
    again = journal(tmp_path)  # a second retry takes the next free name: an archive is never overwritten
    assert again.open(reqs("a", "b", "c"), retry_errors=True) == {"a"}
    again.close()
    assert again.retried_from == tmp_path / "out.errors.retried-2.jsonl" and again.retried == 1
    assert (tmp_path / "out.errors.retried-1.jsonl").read_bytes() == failed


def test_retry_errors_leaves_a_refused_journal_untouched(tmp_path):
    j = journal(tmp_path)
    text = rec("b") + rec("zzz")
    j.errors.write_bytes(text)
    with pytest.raises(BatchError, match=r"out.errors.jsonl:2: custom_id 'zzz' is not in"):
        j.open(reqs("a", "b", "c"), retry_errors=True)
    assert j.errors.read_bytes() == text and not list(tmp_path.glob("*.retried-*"))
    clean = journal(tmp_path, ids=("a", "b", "c", "zzz"))
    assert clean.open(reqs("a", "b", "c", "zzz")) == {"b", "zzz"}  # without the flag nothing is retried
    clean.close()
    assert clean.retried == 0 and not list(tmp_path.glob("*.retried-*"))


def _roles(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}')  # no final newline: b is a line, not torn
    out = tmp_path / "out.jsonl"
    return inp, out, {"input": inp, "output": out, "errors": default_errors_path(out), "state": default_state_path(out)}


@pytest.mark.parametrize(
    "role, other, how",
    [
        ("output", "input", "same path"),
        ("output", "input", "relative"),
        ("output", "input", "symlink"),
        ("state", "input", "same path"),
        ("state", "output", "same path"),
        ("errors", "input", "hard link"),
        ("state", "errors", "symlink"),
    ],
)
def test_one_file_in_two_roles_is_refused_before_anything_is_touched(tmp_path, monkeypatch, role, other, how):
    inp, out, paths = _roles(tmp_path)
    paths["output"].write_bytes(rec("a"))  # an output holding a result: it must survive too
    target = paths[other]
    if how == "relative":
        monkeypatch.chdir(tmp_path / "..")
        paths[role] = target.parent.relative_to(tmp_path.parent) / ".." / target.parent.name / target.name
    elif how in ("symlink", "hard link"):
        alias = tmp_path / f"alias-{role}.jsonl"
        if not target.exists():
            target.write_bytes(b"")
        (alias.symlink_to if how == "symlink" else alias.hardlink_to)(target)
        paths[role] = alias
    else:
        paths[role] = target
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    j = Journal(paths["input"], paths["output"], paths["errors"], paths["state"], "http://127.0.0.1:9")
    with pytest.raises(BatchError, match=rf"the {role} file is the {other} file|the {other} file is the {role} file"):
        j.open(reqs("a", "b"))
    after = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # nothing created, cut or overwritten


def test_distinct_files_are_accepted_and_the_inputs_last_line_is_a_request(tmp_path):
    inp, out, paths = _roles(tmp_path)
    j = Journal(inp, out, paths["errors"], paths["state"], "http://127.0.0.1:9")
    assert j.open(reqs("a", "b")) == set() and not j.torn
    j.close()
    assert inp.read_bytes().endswith(b'{"custom_id": "b"}')


def test_a_full_disk_is_one_line_with_its_own_exit_status_and_leaves_no_part_of_a_line(tmp_path, monkeypatch):
    import errno

    import trtpipe.batch.journal as journal_module
    from trtpipe.batch.journal import DiskFullError

    j = journal(tmp_path)
    j.open(reqs("a", "b", "c"))
    j.append(json.loads(rec("a")), failed=False)
    whole = j.output.read_bytes()
    real_write = os.write

    def write_half_then_fill(fd, data):
        if len(data) > 8:
            real_write(fd, bytes(data[:8]))  # the disk fills in the middle of the line
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal_module.os, "write", write_half_then_fill)
    with pytest.raises(DiskFullError) as caught:
        j.append(json.loads(rec("b")), failed=False)
    assert caught.value.exit_code == 4 and caught.value.exit_code not in (0, 1, 2, 3, 130)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"{j.output}: disk full")
    assert j.output.read_bytes() == whole  # the half line is cut back: b stays pending
    monkeypatch.setattr(
        journal_module,
        "atomic_write_json",
        lambda *a: (_ for _ in ()).throw(OSError(errno.EDQUOT, "Disk quota exceeded")),
    )
    with pytest.raises(DiskFullError, match=r"state.json: disk full"):
        j.checkpoint("running")
    j.close()
