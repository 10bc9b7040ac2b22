"""Host buffers and positioned reads and writes: the only way weight bytes
leave or enter a file.

Every block is read into fresh, 64-byte-aligned anonymous memory with
`os.preadv` (no memory map, so nothing loaded ever aliases the file, and no
per-read Python object per run); saved blocks are written from their own
buffers with `os.pwritev`.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_hub_dist.errors import PresetError

if TYPE_CHECKING:
    from keras_hub_dist.formats.base import ByteRuns

__all__ = [
    "FileDescriptors",
    "IOV_MAX",
    "MAX_READ",
    "aligned_empty",
    "contiguous_groups",
    "preadv_full",
    "pwritev_full",
    "read_runs",
    "sorted_pieces",
    "write_runs",
]

# XLA's CPU client aliases host buffers aligned to this instead of copying.
_ALIGNMENT = 64
# Linux caps one read at 0x7ffff000 bytes and one preadv at IOV_MAX iovecs.
MAX_READ = 1 << 30
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Buffers from this size on get their own huge-page-backed anonymous mapping.
_HUGE_PAGE_MIN_BYTES = 4 << 20
_HAS_MADVISE_HUGEPAGE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


class FileDescriptors:
    """Open file descriptors, one per path, opened with `flags` on first use
    (`os.O_RDONLY` to read a checkpoint; `os.O_WRONLY` to fill a file whose
    datasets already exist, hence no `O_CREAT` / `O_TRUNC`)."""

    def __init__(self, flags: int = os.O_RDONLY) -> None:
        self._flags = flags
        self._fds: dict[str, int] = {}

    def __call__(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, self._flags)
        return self._fds[path]

    def sync(self) -> None:
        """Flushes every open file to the disk (`os.fsync`)."""
        for fd in self._fds.values():
            os.fsync(fd)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A fresh, uninitialized, C-contiguous array aligned to 64 bytes.

    Large buffers are anonymous memory (not a file) that asks the kernel for
    transparent huge pages: filling fresh memory costs a page fault per 4 KiB
    page otherwise, which is most of the time of reading a cached file.
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= _HUGE_PAGE_MIN_BYTES and _HAS_MADVISE_HUGEPAGE:
        anonymous = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):
            anonymous.madvise(mmap.MADV_HUGEPAGE)
        return np.frombuffer(anonymous, dtype=dtype).reshape(shape)
    raw = np.empty(nbytes + _ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def preadv_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Fills `buffers`, in order, from the contiguous file bytes at `offset`.

    Returns:
        The number of `preadv` calls made.

    Raises:
        PresetError: The file ended before every buffer was filled.
    """
    total = sum(len(b) for b in buffers)
    done = 0
    calls = 0
    pending = buffers
    while pending:
        n = os.preadv(fd, pending, offset + done)
        calls += 1
        if n <= 0:
            raise PresetError(
                f"The weights file ended early: expected {total} bytes at "
                f"offset {offset}, read {done}. Received: a file that shrank "
                "or changed during the load."
            )
        done += n
        pending = _after(pending, n)
    return calls


def _after(buffers: list[memoryview], n: int) -> list[memoryview]:
    """What is left of `buffers` once `n` bytes went through: a short read
    or write (signals, > 2 GiB requests) resumes mid-buffer."""
    while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers = buffers[1:]
    if buffers and n:
        buffers = [buffers[0][n:]] + buffers[1:]
    return buffers


def read_runs(
    fd: int,
    runs: ByteRuns,
    out: np.ndarray,
    on_read: Callable[[int, int], None] | None = None,
) -> None:
    """Reads `runs` one after another into C-contiguous `out`.

    `on_read(nbytes, calls)` is told of every read, for statistics.
    """
    flat = memoryview(out.reshape(-1).view(np.uint8))
    position = 0
    for offset, length in runs:
        end = position + length
        while position < end:  # at most MAX_READ per call
            step = min(end - position, MAX_READ)
            calls = preadv_full(fd, [flat[position : position + step]], offset)
            if on_read is not None:
                on_read(step, calls)
            position += step
            offset += step


def pwritev_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Writes `buffers`, in order, to the contiguous file bytes at `offset`.

    Returns:
        The number of `pwritev` calls made (a short write resumes).
    """
    calls = 0
    pending = buffers
    while pending:
        n = os.pwritev(fd, pending, offset)
        calls += 1
        if n <= 0:
            raise OSError(f"pwritev wrote nothing at offset {offset}")
        offset += n
        pending = _after(pending, n)
    return calls


def write_runs(fd: int, runs: ByteRuns, values: np.ndarray) -> int:
    """Writes C-contiguous `values` as `runs`, one after another.

    Returns:
        The number of `pwritev` calls made.
    """
    flat = memoryview(values.reshape(-1).view(np.uint8))
    position = 0
    calls = 0
    for offset, length in runs:
        end = position + length
        while position < end:  # at most MAX_READ per call
            step = min(end - position, MAX_READ)
            calls += pwritev_full(fd, [flat[position : position + step]], offset)
            position += step
            offset += step
    return calls


def sorted_pieces(
    block_runs: Sequence[ByteRuns],
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Every run of every block as `(file offset, length, block number,
    offset in the block's buffer)`, four lists sorted by file offset."""
    offsets, lengths, owners, targets = [], [], [], []
    for i, runs in enumerate(block_runs):
        if not runs.num_runs:
            continue
        if runs.counts:
            grid = np.indices(runs.counts).reshape(len(runs.counts), -1)
            starts = runs.offset + (np.asarray(runs.strides)[:, None] * grid).sum(axis=0)
        else:
            starts = np.asarray([runs.offset])
        offsets.append(starts)
        lengths.append(np.full(starts.size, runs.run_bytes))
        owners.append(np.full(starts.size, i))
        targets.append(np.arange(starts.size) * runs.run_bytes)
    if not offsets:
        return [], [], [], []
    offset = np.concatenate(offsets)
    order = np.argsort(offset, kind="stable")
    return (
        offset[order].tolist(),
        np.concatenate(lengths)[order].tolist(),
        np.concatenate(owners)[order].tolist(),
        np.concatenate(targets)[order].tolist(),
    )


def contiguous_groups(offsets: Sequence[int], lengths: Sequence[int]) -> Iterator[tuple[int, int]]:
    """`(i, j)` per stretch of pieces `i:j` that are back to back in the
    file: one `preadv`/`pwritev` each (at most `IOV_MAX` pieces, `MAX_READ`
    bytes)."""
    i, count = 0, len(offsets)
    while i < count:
        size = lengths[i]
        j = i + 1
        while (
            j < count
            and j - i < IOV_MAX
            and size + lengths[j] <= MAX_READ
            and offsets[j] == offsets[j - 1] + lengths[j - 1]
        ):
            size += lengths[j]
            j += 1
        yield i, j
        i = j
