"""Executes a `LoadPlan`: read each block's bytes, cast, place, assemble.

The thin second phase of loading. For every variable of the plan:

1. each distinct local block is read from the weights file into a fresh,
   64-byte-aligned host buffer that nothing else references (`os.preadv` of
   its exact runs, or scatter reads of the file's contiguous stretches into
   several blocks' buffers at once, see `_load_plan`), and cast to the
   variable's dtype on the host, block by block;
2. the buffer goes to the first device that holds the block
   (`jax.device_put`; on CPU this may alias the buffer, which is safe because
   the loader drops it at once) and is copied device-to-device to the other
   local devices holding the same block, so a replicated variable is read once
   per process, never once per device;
3. the per-device arrays are assembled with
   `jax.make_array_from_single_device_arrays` into the variable's final
   sharding and handed to `on_variable`.

No full tensor is ever put on one device (unless the variable is replicated),
no file is memory-mapped, and nothing returned depends on the file: the
preset can be deleted or overwritten as soon as this returns.
"""

from __future__ import annotations

import collections
import contextlib
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

import jax
import numpy as np

from keras_hub_dist._load_plan import Block, LoadPlan, VariablePlan
from keras_hub_dist.errors import PresetError

__all__ = ["ExecuteStats", "ProgressBar", "aligned_empty", "execute_plan"]

# XLA's CPU client aliases host buffers aligned to this instead of copying.
_ALIGNMENT = 64
# Linux caps one read at 0x7ffff000 bytes and one preadv at IOV_MAX iovecs.
_MAX_READ = 1 << 30
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Buffers from this size on get their own huge-page-backed anonymous mapping.
_HUGE_PAGE_MIN_BYTES = 4 << 20
_HAS_MADVISE_HUGEPAGE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
# On accelerators device_put is asynchronous; the host buffers of transfers
# in flight stay alive until they finish. Wait once this many bytes are
# pending, so host memory stays bounded by it.
_MAX_PENDING_BYTES = 1 << 30


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


@dataclass
class ExecuteStats:
    """What the executor did: bytes and read calls, per process."""

    bytes_read: int = 0
    read_calls: int = 0
    blocks: int = 0
    device_copies: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, nbytes: int, calls: int) -> None:
        with self._lock:  # reader threads report concurrently
            self.bytes_read += nbytes
            self.read_calls += calls


class ProgressBar:
    """A one-line progress bar over bytes, on stderr (no dependency).

    Args:
        total: Bytes expected.
        label: Text before the bar.
        enabled: Draw at all; `None` means only when `stream` is a TTY.
        stream: Where to draw (default `sys.stderr`).
    """

    def __init__(
        self,
        total: int,
        label: str,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total = max(int(total), 1)
        self.label = label
        self.done = 0
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, nbytes: int) -> None:
        self.done += int(nbytes)
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(self.done / self.total, 1.0)
        width = 30
        filled = int(fraction * width)
        rate = self.done / max(now - self._t0, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
            f"{fraction:4.0%} {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
            f"{rate / 1e9:.2f} GB/s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()


class _Files:
    """Open file descriptors (and h5py handles) of the weights files."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._h5: dict[str, Any] = {}

    def fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def h5(self, path: str) -> Any:
        if path not in self._h5:
            import h5py

            self._h5[path] = h5py.File(path, "r")
        return self._h5[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        for f in self._h5.values():
            f.close()
        self._fds.clear()
        self._h5.clear()


def _pread_into(fd: int, buffer: memoryview, offset: int, stats: ExecuteStats) -> None:
    _preadv_full(fd, [buffer], offset, stats)


def _preadv_full(fd: int, buffers: list[memoryview], offset: int, stats: ExecuteStats) -> None:
    """Fills `buffers`, in order, from the contiguous file bytes at `offset`."""
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
    stats.add_read(total, calls)


def _cast(host: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if host.dtype == dtype:
        return host
    out = aligned_empty(host.shape, dtype)
    out[...] = host
    return out


def _read_direct(files: _Files, var: VariablePlan, block: Block, stats: ExecuteStats) -> np.ndarray:
    host = aligned_empty(block.shape, var.source_dtype)
    flat = memoryview(host.reshape(-1).view(np.uint8))
    fd = files.fd(var.dataset.file)
    position = 0
    for offset, length in block.runs:
        end = position + length
        while position < end:  # at most _MAX_READ per call
            step = min(end - position, _MAX_READ)
            _pread_into(fd, flat[position : position + step], offset, stats)
            position += step
            offset += step
    return _cast(host, var.target_dtype)


def _read_h5py(files: _Files, var: VariablePlan, block: Block, stats: ExecuteStats) -> np.ndarray:
    dataset = files.h5(var.dataset.file)[var.dataset.name]
    raw = dataset[block.slices()] if block.shape else dataset[()]
    raw = np.asarray(raw)
    if raw.dtype != var.source_dtype:  # Keras's bfloat16 is stored opaque.
        raw = raw.view(var.source_dtype)
    stats.add_read(raw.nbytes, 1)
    out = aligned_empty(block.shape, var.target_dtype)
    out[...] = raw
    return out


def _pieces(var: VariablePlan) -> tuple[list[int], list[int], list[int], list[int]]:
    """Every run of every block as (file offset, length, block, buffer offset),
    sorted by file offset."""
    offsets, lengths, owners, targets = [], [], [], []
    for i, block in enumerate(var.blocks):
        runs = block.runs
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


def _read_scatter(files: _Files, var: VariablePlan, stats: ExecuteStats) -> Iterator[tuple[Block, np.ndarray]]:
    """Reads each contiguous stretch of the file with one `preadv` whose iovecs
    point into the blocks' buffers; yields blocks as they complete."""
    fd = files.fd(var.dataset.file)
    offsets, lengths, owners, targets = _pieces(var)
    left = [0] * len(var.blocks)
    for b in owners:
        left[b] += 1
    hosts: dict[int, np.ndarray] = {}
    views: dict[int, memoryview] = {}
    i, count = 0, len(offsets)
    while i < count:
        start = offsets[i]
        iovecs: list[memoryview] = []
        size = 0
        j = i
        while (
            j < count
            and len(iovecs) < _IOV_MAX
            and size + lengths[j] <= _MAX_READ
            and (j == i or offsets[j] == offsets[j - 1] + lengths[j - 1])
        ):
            b = owners[j]
            if b not in views:
                hosts[b] = aligned_empty(var.blocks[b].shape, var.source_dtype)
                views[b] = memoryview(hosts[b].reshape(-1).view(np.uint8))
            iovecs.append(views[b][targets[j] : targets[j] + lengths[j]])
            size += lengths[j]
            j += 1
        _preadv_full(fd, iovecs, start, stats)
        del iovecs
        for k in range(i, j):
            b = owners[k]
            left[b] -= 1
            if not left[b]:
                del views[b]
                yield var.blocks[b], _cast(hosts.pop(b), var.target_dtype)
        i = j
    for block in var.blocks:  # Blocks of zero bytes.
        if not block.runs.num_runs:
            yield block, aligned_empty(block.shape, var.target_dtype)


def _host_blocks(
    files: _Files,
    var: VariablePlan,
    stats: ExecuteStats,
    pool: ThreadPoolExecutor | None,
    num_threads: int,
) -> Iterator[tuple[Block, np.ndarray]]:
    if var.strategy == "scatter":
        yield from _read_scatter(files, var, stats)
        return
    read = _read_direct if var.strategy == "direct" else _read_h5py
    if pool is None or len(var.blocks) < 2 or var.strategy != "direct":
        for block in var.blocks:
            yield block, read(files, var, block, stats)
        return
    files.fd(var.dataset.file)  # opened here, not racing in the threads
    # A few blocks in flight: reads overlap (the GIL is released in preadv and
    # page faults), while host memory stays bounded by the window.
    window: collections.deque = collections.deque()
    blocks = iter(var.blocks)
    for block in blocks:
        window.append((block, pool.submit(read, files, var, block, stats)))
        if len(window) > num_threads:
            done_block, future = window.popleft()
            yield done_block, future.result()
    while window:
        done_block, future = window.popleft()
        yield done_block, future.result()


def execute_plan(
    plan: LoadPlan,
    shardings: Mapping[str, jax.sharding.Sharding],
    devices: Mapping[int, Any],
    on_variable: Callable[[VariablePlan, jax.Array], None],
    *,
    progress: ProgressBar | None = None,
    num_threads: int = 2,
) -> ExecuteStats:
    """Reads and places every variable of `plan`, calling `on_variable` per one.

    Args:
        plan: The plan of this process.
        shardings: Variable path -> the `jax.sharding.Sharding` of its final
            array (its addressable devices must be the plan's devices).
        devices: Device id -> `jax.Device`.
        on_variable: Receives each variable's plan and global `jax.Array` as
            soon as it is complete (e.g. to fill the Keras variable).
        progress: Advanced by the bytes read.
        num_threads: Blocks of a variable read concurrently (`"direct"`
            strategy); 1 reads everything in the calling thread.

    Returns:
        `ExecuteStats` of this process.

    Raises:
        PresetError: Reading or placing a variable failed; the message names
            the variable path. Every array created so far is deleted first,
            so a failed load leaves no device memory behind.
    """
    stats = ExecuteStats()
    files = _Files()
    created: list[jax.Array] = []
    pending: list[jax.Array] = []
    pending_bytes = 0
    reported = 0
    on_cpu = all(d.platform == "cpu" for d in devices.values())
    pool = ThreadPoolExecutor(num_threads, "keras_hub_dist-read") if num_threads > 1 else None
    try:
        for var in plan.variables:
            try:
                per_device: list[jax.Array] = []
                for block, host in _host_blocks(files, var, stats, pool, num_threads):
                    first = jax.device_put(host, devices[block.device_ids[0]])
                    per_device.append(first)
                    for device_id in block.device_ids[1:]:
                        per_device.append(jax.device_put(first, devices[device_id]))
                        stats.device_copies += 1
                    stats.blocks += 1
                    if progress is not None:
                        progress.update(stats.bytes_read - reported)
                        reported = stats.bytes_read
                    if not on_cpu:
                        pending.append(first)
                        pending_bytes += host.nbytes
                        if pending_bytes >= _MAX_PENDING_BYTES:
                            jax.block_until_ready(pending)
                            pending, pending_bytes = [], 0
                    del host
                array = jax.make_array_from_single_device_arrays(
                    var.shape, shardings[var.path], per_device
                )
                created.append(array)
                del per_device
                on_variable(var, array)
            except PresetError as e:
                raise PresetError(f"Loading variable {var.path!r} failed: {e}") from e
            except Exception as e:  # noqa: BLE001 - re-raised with the path
                raise PresetError(
                    f"Loading variable {var.path!r} (shape {var.shape}, "
                    f"{var.source_dtype} -> {var.target_dtype}, spec "
                    f"{var.spec}) from {var.dataset.file!r} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
        jax.block_until_ready(created)
    except BaseException:
        for array in created:
            try:
                array.delete()
            except Exception:  # noqa: BLE001 - already deleted
                pass
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        files.close()
        if progress is not None:
            progress.close()
    return stats
