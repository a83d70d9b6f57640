"""The output and errors files of a batch job, which are its journal, and the state file that checkpoints it.

Policy (what "each ``custom_id`` exactly once, nothing lost, across ``kill -9``" rests on):
  * A finished request is one line, written with a single ``write`` to a file opened ``O_APPEND`` and then
    ``fsync``'d before the job counts it done. So the files only ever grow by whole lines, except the last line
    of a job killed inside that ``write``: a torn line, without its newline.
  * On start, each file is cut back to its last newline (the torn line is removed, and its request sent again:
    it was never counted done), every line is parsed, and its ``custom_id`` is done. Anything else in the files
    (a line that is not JSON, an id written twice, an id the input does not have) means they are not this job's
    journal, and the job refuses to touch them.
  * The two files are the only truth about what is done; the state file is a summary of them (counts, sizes, the
    input's hash, whether the job completed) for people and monitors, written atomically, so a reader never sees
    half of it, and never consulted for what to send.
  * The output file is ``flock``'d for the whole job: a second job on the same output is refused, and the kernel
    drops the lock when a job dies, even by SIGKILL.
  * Retrying the failed requests (``--retry-errors``) renames the errors file, under that lock, to the first free
    ``<errors>.retried-N.jsonl`` and starts an empty one: its requests are then not done and are sent again, and
    the earlier answers stay on disk. The rename is one atomic step, so a job killed at any moment leaves either
    the old errors file (nothing retried yet) or the archive (the requests pending, sent by the next run).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trtpipe.batch.requests import BatchError, BatchRequest
from trtpipe.pipeline.cache import atomic_write_json, fsync_dir, sha256_file
from trtpipe.processes import read_state

STATE_FORMAT = "trtpipe-batch-state/1"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(BatchError):
    """The disk (or quota) filled while the job wrote a result or its state: one line, its own exit status; the
    job stops resumable (a partly written line is cut back before this is raised)."""

    exit_code = 4


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same resolved path (symlinks, ``..``, relative paths) or, where both
    exist, the same inode (hard links)."""
    if a.resolve() == b.resolve():
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def check_distinct(roles: dict[str, Path]) -> None:
    """BatchError naming both roles when any two of the job's files (input, output, errors, state) are one file:
    appending results to the input, or checkpointing over a journal, would lose data. Touches nothing."""
    items = [(role, Path(path)) for role, path in roles.items()]
    for i, (role_a, a) in enumerate(items):
        for role_b, b in items[i + 1 :]:
            if _same_file(a, b):
                raise BatchError(f"{b}: the {role_b} file is the {role_a} file ({a}); give each its own file")


def default_errors_path(output: Path) -> Path:
    """``results.jsonl`` -> ``results.errors.jsonl``."""
    output = Path(output)
    return output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")


def retried_errors_path(errors: Path) -> Path:
    """The first free ``results.errors.retried-N.jsonl`` beside ``errors`` (an archive is never overwritten)."""
    errors = Path(errors)
    n = 1
    while True:
        candidate = errors.with_name(f"{errors.stem}.retried-{n}{errors.suffix or '.jsonl'}")
        if not candidate.exists():
            return candidate
        n += 1


def default_state_path(output: Path) -> Path:
    """``results.jsonl`` -> ``results.jsonl.state.json``."""
    output = Path(output)
    return output.with_name(f"{output.name}.state.json")


@dataclass
class Recovered:
    """What a journal file held when the job started."""

    ids: dict[str, int] = field(default_factory=dict)  # custom_id -> line
    torn_bytes: int = 0  # the torn last line that was cut off (0: none)


def recover(path: Path) -> Recovered:
    """Cut ``path`` back to its last newline (fsync'd) and read the custom_id of every line; BatchError naming
    file:line for a line that is not a result line, or an id written twice. Streams: one line in memory at once."""
    path = Path(path)
    out = Recovered()
    whole = 0  # bytes of complete lines
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    break  # the torn last line
                whole += len(raw)
                _read_line(path, n, raw, out.ids)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise BatchError(f"{path}: cannot read: {exc.strerror or exc}") from None
    out.torn_bytes = size - whole
    if out.torn_bytes:
        with open(path, "r+b") as f:
            f.truncate(whole)
            f.flush()
            os.fsync(f.fileno())
    return out


def _read_line(path: Path, n: int, raw: bytes, ids: dict[str, int]) -> None:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        obj = None
    cid = obj.get("custom_id") if isinstance(obj, dict) else None
    if not isinstance(cid, str):
        raise BatchError(f"{path}:{n}: not a batch result line (no custom_id); is this another program's file?")
    if cid in ids:
        raise BatchError(f"{path}:{n}: custom_id {cid!r} written twice (first on line {ids[cid]})")
    ids[cid] = n


def _disk_full(path: Path, exc: OSError) -> Exception:
    """DiskFullError for a full disk or quota, else BatchError naming the file (one line either way)."""
    if exc.errno in DISK_FULL_ERRNOS:
        return DiskFullError(
            f"{path}: disk full ({exc.strerror}); the job stopped, free space and rerun the same command to resume"
        )
    return BatchError(f"{path}: cannot write: {exc.strerror or exc}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Journal:
    """Open (recover, lock) the output and errors files; append results; checkpoint the state file."""

    def __init__(self, input_path: Path, output: Path, errors: Path, state: Path, target: str):
        self.input_path, self.output, self.errors, self.state = (
            Path(input_path),
            Path(output),
            Path(errors),
            Path(state),
        )
        self.target = target
        self.succeeded = self.failed = 0  # lines in each file (earlier runs included)
        self.written_now = 0  # lines this run wrote
        self.torn: list[str] = []  # "file: N bytes" for each torn line cut off at start
        self.runs = 1
        self.first_started = time.time()
        self.started = time.time()
        self.total = 0
        self.input_sha256 = ""
        self._out_fd: Optional[int] = None
        self._err_fd: Optional[int] = None
        self._last_checkpoint = 0.0
        self.retried_from: Optional[Path] = None  # where --retry-errors moved the failed requests' lines
        self.retried = 0  # how many failed requests that made pending again

    # --- start ------------------------------------------------------------------------------------------

    def open(self, requests: list[BatchRequest], retry_errors: bool = False) -> set[str]:
        """Lock the output, recover both files, check them against ``requests``; return the ids already done.
        ``retry_errors``: the errors file's requests are not done (it is archived first, see the module policy)."""
        check_distinct({"input": self.input_path, "output": self.output, "errors": self.errors, "state": self.state})
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.errors.parent.mkdir(parents=True, exist_ok=True)
        self._out_fd = os.open(self.output, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._out_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise BatchError(f"{self.output}: another trtpipe batch is writing this output") from None
            raise
        try:
            return self._recover(requests, retry_errors)
        except BaseException:
            self.close()
            raise

    def _recover(self, requests: list[BatchRequest], retry_errors: bool) -> set[str]:
        ok, bad = recover(self.output), recover(self.errors)
        for path, r in ((self.output, ok), (self.errors, bad)):
            if r.torn_bytes:
                self.torn.append(f"{path}: {r.torn_bytes} bytes")
        both = set(ok.ids) & set(bad.ids)
        if both:
            cid = min(both, key=lambda c: ok.ids[c])
            raise BatchError(
                f"{self.errors}:{bad.ids[cid]}: custom_id {cid!r} is also in {self.output} (line {ok.ids[cid]})"
            )
        wanted = {r.custom_id for r in requests}
        for path, r in ((self.output, ok), (self.errors, bad)):
            stray = [c for c in r.ids if c not in wanted]
            if stray:
                cid = min(stray, key=lambda c: r.ids[c])
                raise BatchError(
                    f"{path}:{r.ids[cid]}: custom_id {cid!r} is not in {self.input_path} "
                    "(the output of another batch? use another --output)"
                )
        if retry_errors and bad.ids:  # checked first: a refused journal is left exactly as it was
            self.retried_from, self.retried = retried_errors_path(self.errors), len(bad.ids)
            os.rename(self.errors, self.retried_from)
            bad = Recovered()
        self._err_fd = os.open(self.errors, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for d in {self.output.parent, self.errors.parent}:
            fsync_dir(d)  # the files' names survive a crash too
        self.succeeded, self.failed, self.total = len(ok.ids), len(bad.ids), len(requests)
        prior = read_state(self.state)
        if isinstance(prior, dict) and prior.get("format") == STATE_FORMAT:
            self.runs = int(prior.get("runs", 0)) + 1
            self.first_started = float(prior.get("first_started_unix", self.started))
        self.input_sha256 = sha256_file(self.input_path)
        self.checkpoint("running")
        return set(ok.ids) | set(bad.ids)

    # --- results ----------------------------------------------------------------------------------------

    def append(self, record: dict[str, Any], failed: bool) -> None:
        """One result line, durable (fsync'd) before this returns."""
        fd = self._err_fd if failed else self._out_fd
        path = self.errors if failed else self.output
        size = os.fstat(fd).st_size  # the one writer (flock): where this line starts
        try:
            _write_all(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
            os.fsync(fd)
        except OSError as exc:
            if exc.errno in DISK_FULL_ERRNOS:
                os.ftruncate(fd, size)  # no part of the line stays: its request is pending for the next run
            raise _disk_full(path, exc) from None
        self.written_now += 1
        if failed:
            self.failed += 1
        else:
            self.succeeded += 1

    @property
    def done(self) -> int:
        return self.succeeded + self.failed

    # --- state ------------------------------------------------------------------------------------------

    def state_doc(self, status: str) -> dict[str, Any]:
        def size(p: Path) -> int:
            try:
                return p.stat().st_size
            except OSError:
                return 0

        now = time.time()
        return {
            "format": STATE_FORMAT,
            "status": status,
            "input": str(self.input_path),
            "input_sha256": self.input_sha256,
            "output": str(self.output),
            "errors": str(self.errors),
            "target": self.target,
            "total": self.total,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "pending": self.total - self.done,
            "output_bytes": size(self.output),
            "errors_bytes": size(self.errors),
            "runs": self.runs,
            "pid": os.getpid(),
            "first_started_unix": self.first_started,
            "run_started_unix": self.started,
            "updated_unix": now,
            "run_elapsed_s": round(now - self.started, 3),
            "written_this_run": self.written_now,
        }

    def checkpoint(self, status: str = "running") -> None:
        """Write the state file atomically (old or new content, never a part)."""
        try:
            atomic_write_json(self.state, self.state_doc(status))
        except OSError as exc:
            raise _disk_full(self.state, exc) from None
        self._last_checkpoint = time.monotonic()

    def checkpoint_due(self, interval_s: float) -> bool:
        return time.monotonic() - self._last_checkpoint >= interval_s

    def close(self) -> None:
        for name in ("_out_fd", "_err_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)  # closing the output releases its flock
                setattr(self, name, None)
