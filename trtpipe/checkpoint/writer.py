"""Streaming safetensors writer: the header is planned from shapes, then tensor data is streamed in.

A rank file's header (names, dtypes, shapes, offsets) is known before any weight is read, because the
conversion is first run on ``meta`` tensors. Each tensor is then written at its planned offset with
``pwrite`` in chunks of a few tens of MB, cast chunk by chunk: a strided shard or a float32 -> float16
cast never needs a full contiguous copy. Files are written into a temporary directory that is renamed
into place only when everything succeeded (:func:`atomic_dir`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from trtpipe.checkpoint.hf import has_non_finite, non_finite_error, row_chunks
from trtpipe.errors import CheckpointError

TORCH_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CHUNK_BYTES = 32 << 20
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_buffers() -> None:
    """Make glibc map every buffer of 1 MB or more on its own and unmap it when freed, for this process.

    glibc raises its mmap threshold to the size of each large buffer freed, up to 32 MB; after the first one the
    writer's chunks and a fused layer's temporaries come from per-thread heaps, which keep freed memory resident.
    Converting 70B-shaped FP8 layers at tp 4 (scripts/bench_import.py) that grew the peak by 35-96 MB per layer; with a
    fixed threshold it is the same for every layer. A no-op where the C library is not glibc.
    """
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass


class RankFile:
    """One ``rank{N}.safetensors`` laid out from ``(name, dtype, shape)`` entries, then filled by ``write``."""

    def __init__(self, path: Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path = Path(path)
        header: dict = {"__metadata__": {"format": "pt"}}
        self.slots: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name, dtype, shape in entries:
            if name in self.slots:
                raise CheckpointError(f"{self.path.name}: tensor '{name}' planned twice")
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= int(s)
            header[name] = {
                "dtype": TORCH_TO_ST[dtype],
                "shape": [int(s) for s in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self.slots[name] = (dtype, tuple(int(s) for s in shape), offset)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
        self.base = 8 + len(raw)
        self.size = self.base + offset
        self.written: set[str] = set()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with _naming(self.path):
            os.pwrite(self.fd, len(raw).to_bytes(8, "little") + raw, 0)
            os.ftruncate(self.fd, self.size)

    def slot(self, name: str, t: torch.Tensor) -> tuple[torch.dtype, int]:
        """(planned dtype, absolute file offset) of ``name``, after checking ``t`` has the planned shape."""
        return self.slot_bytes(name, t.shape)[:2]

    def slot_bytes(self, name: str, shape) -> tuple[torch.dtype, int, int]:
        """(planned dtype, absolute file offset, bytes) of ``name``, after checking ``shape`` is the planned one."""
        if name not in self.slots:
            raise CheckpointError(f"{self.path.name}: tensor '{name}' was not planned")
        dtype, planned, offset = self.slots[name]
        if shape is not None and tuple(shape) != planned:
            raise CheckpointError(f"{self.path.name}: tensor '{name}' has shape {list(shape)}, planned {list(planned)}")
        nbytes = dtype.itemsize
        for s in planned:
            nbytes *= s
        return dtype, self.base + offset, nbytes

    def write(
        self,
        name: str,
        t: torch.Tensor,
        check: Optional[str] = None,
        after_chunk: Optional[Callable[[torch.Tensor], None]] = None,
    ) -> None:
        """Write ``t`` (any strides; cast to the planned dtype chunk by chunk) into its slot.

        Args:
            check: when given, refuse NaN/Inf in the source data; the error starts with this text.
            after_chunk: called with each source chunk once written (drops mapped pages).
        """
        write_same([self], name, t, check, after_chunk)

    def close(self) -> None:
        missing = set(self.slots) - self.written
        os.close(self.fd)
        if missing:
            raise CheckpointError(f"{self.path.name}: tensor '{sorted(missing)[0]}' was planned but never written")


@contextlib.contextmanager
def _naming(path: Path):
    """A failed write (disk full, file size limit) names the file it was writing: os.pwrite's error does not."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while data:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def write_same(
    files: list[RankFile],
    name: str,
    t: torch.Tensor,
    check: Optional[str] = None,
    after_chunk: Optional[Callable[[torch.Tensor], None]] = None,
) -> None:
    """Write one tensor into several files (a replicated tensor): each chunk is read, checked and cast once."""
    slots = [f.slot(name, t) for f in files]
    positions = [pos for _, pos in slots]
    for chunk in row_chunks(t, CHUNK_BYTES):
        if check is not None and has_non_finite(chunk):
            raise non_finite_error(chunk, check)
        cast: dict = {}
        for i, (f, (dtype, _)) in enumerate(zip(files, slots)):
            if dtype not in cast:
                cast[dtype] = memoryview(chunk.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
            with _naming(f.path):
                _pwrite_all(f.fd, cast[dtype], positions[i])
            positions[i] += len(cast[dtype])
        if after_chunk is not None:
            after_chunk(chunk)
    for f in files:
        f.written.add(name)


def write_parts(
    f: RankFile,
    name: str,
    parts: list[tuple[torch.Tensor, str]],
    check: Optional[str] = None,
    after_chunk: Optional[Callable[[torch.Tensor], None]] = None,
) -> None:
    """Fill the slot of ``name`` with ``parts`` one after the other (each any strides, cast chunk by chunk): a
    tensor written from pieces that are never concatenated in memory (stacked MoE experts).

    Args:
        parts: (tensor, source name); their elements, in order, are the slot's.
        check: when given, refuse NaN/Inf; the error names the part's source after this text.
    """
    dtype, pos, nbytes = f.slot_bytes(name, None)
    end = pos + nbytes
    for part, source in parts:
        for chunk in row_chunks(part, CHUNK_BYTES):
            if check is not None and has_non_finite(chunk):
                raise non_finite_error(chunk, f"{check} '{source}'")
            data = memoryview(chunk.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
            if pos + len(data) > end:
                raise CheckpointError(f"{f.path.name}: tensor '{name}': its parts exceed the planned {nbytes} bytes")
            with _naming(f.path):
                _pwrite_all(f.fd, data, pos)
            pos += len(data)
            if after_chunk is not None:
                after_chunk(chunk)
    if pos != end:
        raise CheckpointError(
            f"{f.path.name}: tensor '{name}': its parts fill {nbytes - (end - pos)} of the planned {nbytes} bytes"
        )
    f.written.add(name)


@contextlib.contextmanager
def atomic_dir(out_dir: Path, overwrite: bool = False):
    """Yield a temporary sibling directory; on success it replaces ``out_dir``, on failure it is removed.

    An existing non-empty ``out_dir`` is an error unless ``overwrite``.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir}: exists and is not empty (pass --overwrite to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
