"""Host buffers and positioned reads: the only way weight bytes leave a file.

Every block is read into fresh, 64-byte-aligned anonymous memory with
`os.preadv` (no memory map, so nothing loaded ever aliases the file, and no
per-read Python object per run).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from keras_hub_dist.errors import PresetError

if TYPE_CHECKING:
    from keras_hub_dist.formats.base import ByteRuns

__all__ = ["IOV_MAX", "MAX_READ", "aligned_empty", "preadv_full", "read_runs"]

# XLA's CPU client aliases host buffers aligned to this instead of copying.
_ALIGNMENT = 64
# Linux caps one read at 0x7ffff000 bytes and one preadv at IOV_MAX iovecs.
MAX_READ = 1 << 30
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Buffers from this size on get their own huge-page-backed anonymous mapping.
_HUGE_PAGE_MIN_BYTES = 4 << 20
_HAS_MADVISE_HUGEPAGE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")


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
        # A short read (signals, > 2 GiB requests) resumes mid-buffer.
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending = pending[1:]
        if pending and n:
            pending = [pending[0][n:]] + pending[1:]
    return calls


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
