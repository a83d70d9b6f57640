"""The artifact cache: crash-safe writes, one folder per (stage, key), and the work-dir lock.

Policy (what "a build killed at any moment leaves no artifact that looks complete" rests on):
  * A stage writes into ``artifacts/<stage>/.tmp-<key>-<pid>-<rand>/`` in the same parent as its final folder.
  * When it returns, every file is fsync'd, the completion marker ``.trtpipe-complete.json`` (key, key material,
    the sha256 and size of every file) is written last and fsync'd, then the folder is renamed into place
    (``rename`` is atomic within one file system) and the parent fsync'd.
  * A folder counts as complete only if its marker parses, names its own key, and every listed file is there
    with its recorded size. Anything else is rebuilt.
  * Replacing an artifact (``--force``) renames the old folder aside to ``.old-...`` first; the old one is
    deleted only after the new one is in place. A crash between the two renames leaves the old folder whole,
    and the next run puts it back.
  * The next build (holding the lock, so no other build is writing) deletes stale ``.tmp-`` folders.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from trtpipe.errors import TrtpipeError
from trtpipe.jsonfile import load_json

MARKER = ".trtpipe-complete.json"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
LOCK_NAME = ".build.lock"


class BuildLockedError(TrtpipeError):
    """Another build holds the work directory's lock."""


# --- durable writes ------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under ``root`` (data before the marker that vouches for it)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                fd = os.open(full, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(Path(dirpath))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` so that readers see the old content or the new, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


# --- hashing -------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, dict]:
    """``{relative posix path: {"sha256", "size"}}`` of every file under ``root`` except the marker."""
    out: dict[str, dict] = {}
    for dirpath, dirs, names in os.walk(root, followlinks=True):
        dirs.sort()
        for name in sorted(names):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if rel == MARKER:
                continue
            out[rel] = {"sha256": sha256_file(full), "size": full.stat().st_size}
    return out


# --- the work-dir lock ---------------------------------------------------------------------------


class WorkDirLock:
    """An exclusive ``flock`` on ``<work_dir>/.build.lock`` for the whole build.

    The kernel drops a flock when its process dies, even by SIGKILL, so a killed build never leaves the
    work dir locked.
    """

    def __init__(self, work_dir: Path):
        self.path = Path(work_dir) / LOCK_NAME
        self._fd: Optional[int] = None

    def __enter__(self) -> "WorkDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise BuildLockedError(
                    f"{self.path.parent}: another build is running here ({holder}); "
                    "wait for it to finish or use another work_dir"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock; the file stays (unlinking it would race)
            self._fd = None


# --- the artifact store --------------------------------------------------------------------------


class ArtifactStore:
    """``<work_dir>/artifacts/<stage>/<key>/`` folders, written only through :meth:`begin` / :meth:`commit`."""

    def __init__(self, work_dir: Path):
        self.work_dir = Path(work_dir)
        self.root = self.work_dir / "artifacts"

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def marker(self, stage: str, key: str) -> Optional[dict]:
        """The completion marker of a complete artifact, or None (missing, half-written, or damaged)."""
        folder = self.path(stage, key)
        try:
            marker = load_json(folder / MARKER)
        except (OSError, ValueError):
            return None
        if not isinstance(marker, dict) or marker.get("key") != key or marker.get("stage") != stage:
            return None
        for rel, meta in marker.get("files", {}).items():
            try:
                if (folder / rel).stat().st_size != meta["size"]:
                    return None
            except (OSError, KeyError, TypeError):
                return None
        return marker

    def keys(self, stage: str) -> list[str]:
        """Keys of the complete artifacts of one stage."""
        folder = self.root / stage
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and self.marker(stage, p.name))

    def begin(self, stage: str, key: str) -> Path:
        """A fresh temporary folder beside the final one (same file system, so the rename is atomic)."""
        parent = self.root / stage
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f"{TMP_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, stage: str, key: str, marker: dict) -> dict:
        """Seal ``tmp`` (hash, fsync, marker last) and move it to ``path(stage, key)``; return the marker."""
        marker = {"stage": stage, "key": key, **marker, "files": hash_tree(tmp)}
        fsync_tree(tmp)
        atomic_write_json(tmp / MARKER, marker)
        final = self.path(stage, key)
        if final.exists():
            old = final.parent / f"{OLD_PREFIX}{key}-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(final, old)
            os.rename(tmp, final)
            fsync_dir(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
            fsync_dir(final.parent)
        return marker

    @staticmethod
    def discard(tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def discard_mine(self, stage: str, key: str) -> None:
        """Remove every temporary folder this process began for (stage, key): a Ctrl-C can land inside
        :meth:`begin`, after the mkdir and before the caller holds the path."""
        for tmp in (self.root / stage).glob(f"{TMP_PREFIX}{key}-{os.getpid()}-*"):
            _remove(tmp)

    def clean_stale(self) -> list[str]:
        """Delete leftovers of killed builds; put back an old artifact a crash left renamed aside.

        Call only while holding the :class:`WorkDirLock` (no other build can be writing).
        Returns one line per action, for the build log.
        """
        actions: list[str] = []
        for folder in (self.work_dir, self.work_dir / "manifests"):  # half-written manifests
            for entry in sorted(folder.glob(f"{TMP_PREFIX}*")) if folder.is_dir() else []:
                _remove(entry)
                actions.append(f"removed stale {entry}")
        if not self.root.is_dir():
            return actions
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for entry in sorted(stage_dir.iterdir()):
                if entry.name.startswith(OLD_PREFIX):
                    key = entry.name[len(OLD_PREFIX) :].split("-", 1)[0]
                    final = stage_dir / key
                    sealed = (entry / MARKER).is_file()
                    if sealed and not final.exists():
                        os.rename(entry, final)
                        fsync_dir(stage_dir)
                        actions.append(f"restored {final} (a build was killed while replacing it)")
                        continue
                    _remove(entry)
                    actions.append(f"removed {entry}")
                elif entry.name.startswith(TMP_PREFIX):
                    _remove(entry)
                    actions.append(f"removed stale {entry}")
        return actions


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
