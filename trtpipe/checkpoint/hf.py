"""Read Hugging Face checkpoints one tensor at a time, memory-mapped, checking each tensor as it is read.

Safetensors files are parsed here (header + ``mmap``) rather than through ``safe_open`` so a tensor is a
zero-copy view of the page cache and its pages can be dropped from this process after use
(``release``): peak memory stays at about the largest tensor being transformed, flat in model size.
The header is checked as the safetensors library checks it (``Metadata::validate``: at most 100 MB; each tensor's
``data_offsets`` a non-negative, ordered pair whose length is its shape times its dtype; the tensors tile the data
buffer from byte 0 to its end, no gap, overlap or tail), so no tensor reads header bytes or another tensor's bytes
as weights. A header that points past the end of the file (a truncated download) is reported with the tensor name.
Pickle (``.bin``) checkpoints are refused unless explicitly allowed, then loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import Iterable

import torch

from trtpipe.errors import CheckpointError
from trtpipe.jsonfile import load_json, refuse_special

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
CHECK_ROWS_BYTES = 64 << 20  # finite check granularity
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit (N_LEN's HeaderTooLarge)


class SafetensorsFile:
    """One mmapped safetensors file: header entries and zero-copy tensor views (the checkpoint inspector and the
    engine planner read headers and sizes through it without loading any tensor)."""

    def __init__(self, path: Path):
        self.path = path
        refuse_special(path, CheckpointError)
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: invalid safetensors header: {n} bytes (at most {MAX_HEADER_BYTES})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{path}: invalid safetensors header: {exc}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: invalid safetensors header: a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        spans: dict[str, tuple[int, int]] = {}  # name -> [begin, end) in the data buffer
        for name, e in header.items():
            if not isinstance(e, dict):
                raise CheckpointError(f"{path}: invalid safetensors header: tensor '{name}' is not an object")
            dtype = ST_DTYPES.get(e.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {e.get('dtype')}")
            try:
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(
                    f"{path}: invalid safetensors header: tensor '{name}' needs an integer shape "
                    f"and data_offsets [begin, end]"
                ) from None
            if begin < 0 or end < begin or any(s < 0 for s in shape):
                raise CheckpointError(
                    f"{path}: invalid safetensors header: tensor '{name}' has data_offsets [{begin}, {end}] and shape "
                    f"{list(shape)} (offsets must be 0 <= begin <= end, dimensions >= 0)"
                )
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtype.itemsize:
                raise CheckpointError(
                    f"{path}: tensor '{name}': {end - begin} bytes for shape {list(shape)} {e['dtype']}"
                )
            if self.base + end > size:
                raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {self.base + end} of {size}")
            self.entries[name] = (dtype, shape, self.base + begin, numel)
            spans[name] = (begin, end)
        _check_tiling(path, spans, size - self.base)
        self._fd = os.open(path, os.O_RDONLY)
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if size else None
        self.size = size
        self.base_ptr = 0
        if self._mm is not None:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                self._mm.madvise(mmap.MADV_SEQUENTIAL)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.base_ptr = torch.frombuffer(self._mm, dtype=torch.uint8, count=1).data_ptr()

    def tensor(self, name: str) -> torch.Tensor:
        dtype, shape, offset, numel = self.entries[name]
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the buffer is read-only: the views are never written to
            return torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=offset).view(shape)

    def drop(self, ptr: int, nbytes: int) -> None:
        """Drop the pages of [ptr, ptr+nbytes) if they are in this mapping."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = max(ptr, self.base_ptr), min(ptr + nbytes, self.base_ptr + self.size)
        if start >= end:
            return
        start = (start - self.base_ptr) // mmap.PAGESIZE * mmap.PAGESIZE
        self._mm.madvise(mmap.MADV_DONTNEED, start, end - self.base_ptr - start)

    def release(self) -> None:
        """Drop this file's pages from our resident set (they stay in the OS page cache)."""
        if self._mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        # views handed out keep the mmap alive through the buffer protocol; closing only the fd is safe
        os.close(self._fd)


def _check_tiling(path: Path, spans: dict[str, tuple[int, int]], data_bytes: int) -> None:
    """The tensors' ``[begin, end)`` spans, in offset order, must start at 0, each begin where the last ended, and
    end at the data buffer's end (the safetensors library's ``InvalidOffset`` / ``MetadataIncompleteBuffer``)."""
    at, last = 0, None
    for name, (begin, end) in sorted(spans.items(), key=lambda kv: kv[1]):
        if begin != at:
            how = "overlaps" if begin < at else "leaves a gap after"
            prev = f"tensor '{last}'" if last else "the start of the data"
            raise CheckpointError(
                f"{path}: invalid safetensors header: tensor '{name}' data_offsets begin at {begin}, which {how} "
                f"{prev} (ends at {at})"
            )
        at, last = end, name
    if at != data_bytes:
        raise CheckpointError(
            f"{path}: invalid safetensors header: the tensors cover {at} of the {data_bytes} data bytes after the header"
        )


class HFReader:
    """Tensors of an HF model directory by name: ``shape``/``dtype``/``meta`` without reading, ``get`` to read.

    Args:
        model_dir: directory with ``model.safetensors`` or ``model.safetensors.index.json`` (or ``.bin``).
        allow_pickle: accept ``pytorch_model*.bin`` (loaded with ``torch.load(weights_only=True)``).
        check_finite: refuse NaN/Inf in floating-point tensors when they are read.
    """

    def __init__(self, model_dir: str | Path, allow_pickle: bool = False, check_finite: bool = True):
        self.dir = Path(model_dir)
        self.check_finite = check_finite
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        st = self._weight_files("model.safetensors")
        if st:
            for rel in st:
                self._files[rel] = SafetensorsFile(self.dir / rel)
                for name in self._files[rel].entries:
                    self._where[name] = rel
            self._check_index(st)
            return
        bins = self._weight_files("pytorch_model.bin")
        if not bins:
            raise CheckpointError(
                f"{self.dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
            )
        if not allow_pickle:
            raise CheckpointError(
                f"{self.dir / bins[0]}: pickle checkpoints can run code when loaded; convert to safetensors "
                "or set model.allow_pickle: true (loaded with weights_only=True)"
            )
        for rel in bins:
            try:
                state = torch.load(self.dir / rel, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError...
                raise CheckpointError(
                    f"{self.dir / rel}: cannot load with weights_only=True: {str(exc).splitlines()[0]}"
                ) from None
            self._pickled.update(state)
            self._where.update({k: rel for k in state})

    def _weight_files(self, single: str) -> list[str]:
        index = self.dir / f"{single}.index.json"
        if index.exists():
            refuse_special(index, CheckpointError)
            try:
                weight_map = load_json(index, CheckpointError)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index}: invalid index ({exc})") from None
            self._index = weight_map
            files = sorted(set(weight_map.values()))
            for rel in files:
                if not (self.dir / rel).exists():
                    raise CheckpointError(f"{index}: shard '{rel}' listed in weight_map is missing")
            return files
        self._index = None
        return [single] if (self.dir / single).exists() else []

    def _check_index(self, files: list[str]) -> None:
        if not self._index:
            return
        for name, rel in self._index.items():
            if self._where.get(name) != rel:
                raise CheckpointError(f"{self.dir / rel}: tensor '{name}' listed in the index is not in that file")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _source(self, name: str) -> str:
        if name not in self._where:
            raise CheckpointError(f"{self.dir}: tensor '{name}' is missing")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        rel = self._source(name)
        return tuple(self._pickled[name].shape) if self._pickled else self._files[rel].entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        rel = self._source(name)
        return self._pickled[name].dtype if self._pickled else self._files[rel].entries[name][0]

    def meta(self, name: str) -> torch.Tensor:
        """A tensor with the right shape and dtype and no data (for planning)."""
        return torch.empty(self.shape(name), dtype=self.dtype(name), device="meta")

    def get(self, name: str) -> torch.Tensor:
        """The tensor (a zero-copy view for safetensors), checked for NaN/Inf."""
        rel = self._source(name)
        t = self._pickled[name] if self._pickled else self._files[rel].tensor(name)
        if self.check_finite and t.dtype in FLOATS:
            check_finite(t, f"{self.dir / rel}: tensor '{name}'", self.drop_pages)
        return t

    def drop_pages(self, t: torch.Tensor) -> None:
        """Drop the mapped pages under a view ``t`` (no-op for tensors that are not views of a file)."""
        if not self._files or t.numel() == 0:
            return
        span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
        for f in self._files.values():
            f.drop(t.data_ptr(), span * t.element_size())

    def release(self) -> None:
        """Drop every mapped page from this process (call between layers)."""
        for f in self._files.values():
            f.release()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def row_chunks(t: torch.Tensor, max_bytes: int) -> Iterable[torch.Tensor]:
    """Views of consecutive dim-0 slices of about ``max_bytes`` each (the whole tensor for 0/1-D)."""
    if t.dim() < 2 or t.numel() * t.element_size() <= max_bytes:
        yield t
        return
    row = max(1, t[0].numel() * t.element_size())
    step = max(1, max_bytes // row)
    for start in range(0, t.shape[0], step):
        yield t[start : start + step]


# Exponent bits: a float is NaN or Inf exactly when all of them are set.
_EXPONENT = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def has_non_finite(chunk: torch.Tensor) -> bool:
    """True when ``chunk`` holds a NaN or Inf.

    A sum is non-finite whenever a NaN or Inf is summed, and is many times faster than ``isfinite``;
    only when it is non-finite (which an overflow of large finite weights can also cause) is the exact
    exponent-bit test run.
    """
    if chunk.dtype not in _EXPONENT or chunk.numel() == 0:
        return False
    if bool(torch.isfinite(chunk.sum())):
        return False
    int_type, mask = _EXPONENT[chunk.dtype]
    if chunk.dim() == 0:
        chunk = chunk.reshape(1)
    return int((chunk.view(int_type) & mask).max()) == mask


def non_finite_error(chunk: torch.Tensor, what: str) -> CheckpointError:
    bad = "NaN" if bool(torch.isnan(chunk).any()) else "Inf"
    return CheckpointError(f"{what} contains {bad} values")


def check_finite(t: torch.Tensor, what: str, after_chunk=None) -> None:
    for chunk in row_chunks(t, CHECK_ROWS_BYTES):
        if has_non_finite(chunk):
            raise non_finite_error(chunk, what)
        if after_chunk is not None:
            after_chunk(chunk)


def open_hf(model_dir: str | Path, allow_pickle: bool = False, check_finite: bool = True) -> HFReader:
    return HFReader(model_dir, allow_pickle=allow_pickle, check_finite=check_finite)
