"""Executes a `LoadPlan`: read each block's bytes, cast, place, assemble.

The thin second phase of loading. For every variable of the plan:

1. each distinct local block is read from the weights file into a fresh,
   64-byte-aligned host buffer that nothing else references (`os.preadv` of
   the exact runs, or row bands scattered to the blocks, see `_load_plan`),
   and cast to the variable's dtype on the host, block by block;
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

import contextlib
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Iterator, TextIO

import jax
import numpy as np

from keras_hub_dist._load_plan import Block, LoadPlan, VariablePlan
from keras_hub_dist.errors import PresetError

__all__ = ["ExecuteStats", "ProgressBar", "aligned_empty", "execute_plan"]

# XLA's CPU client aliases host buffers aligned to this instead of copying.
_ALIGNMENT = 64
# Linux caps one read at 0x7ffff000 bytes.
_MAX_READ = 1 << 30
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
    done = 0
    total = len(buffer)
    while done < total:
        n = os.preadv(fd, [buffer[done : done + _MAX_READ]], offset + done)
        stats.read_calls += 1
        if n <= 0:
            raise PresetError(
                f"The weights file ended early: expected {total} bytes at "
                f"offset {offset}, read {done}. Received: a file that shrank "
                "or changed during the load."
            )
        done += n
    stats.bytes_read += total


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
        _pread_into(fd, flat[position : position + length], offset, stats)
        position += length
    return _cast(host, var.target_dtype)


def _read_h5py(files: _Files, var: VariablePlan, block: Block, stats: ExecuteStats) -> np.ndarray:
    dataset = files.h5(var.dataset.file)[var.dataset.name]
    raw = dataset[block.slices()] if block.shape else dataset[()]
    raw = np.asarray(raw)
    if raw.dtype != var.source_dtype:  # Keras's bfloat16 is stored opaque.
        raw = raw.view(var.source_dtype)
    stats.bytes_read += raw.nbytes
    stats.read_calls += 1
    out = aligned_empty(block.shape, var.target_dtype)
    out[...] = raw
    return out


def _read_spans(files: _Files, var: VariablePlan, stats: ExecuteStats) -> Iterator[tuple[Block, np.ndarray]]:
    """Reads row bands once and scatters them; yields blocks as they complete."""
    fd = files.fd(var.dataset.file)
    row_bytes = var.row_bytes
    rest = var.shape[1:]
    largest = max(stop - start for start, stop in var.spans)
    scratch = aligned_empty((largest,) + rest, var.source_dtype)
    buffers: dict[int, np.ndarray] = {}
    pending = list(var.blocks)
    for start, stop in var.spans:
        band = scratch[: stop - start]
        _pread_into(
            fd,
            memoryview(band.reshape(-1).view(np.uint8)),
            var.dataset.offset + start * row_bytes,
            stats,
        )
        for i, block in enumerate(var.blocks):
            b_start, b_stop = block.index[0]
            lo, hi = max(start, b_start), min(stop, b_stop)
            if lo >= hi:
                continue
            if i not in buffers:
                buffers[i] = aligned_empty(block.shape, var.target_dtype)
            buffers[i][lo - b_start : hi - b_start] = band[
                (slice(lo - start, hi - start),) + block.slices()[1:]
            ]
        still = []
        for block in pending:
            if block.index[0][1] <= stop:
                yield block, buffers.pop(var.blocks.index(block))
            else:
                still.append(block)
        pending = still
    del scratch
    for block in pending:  # Only blocks of zero rows can be left.
        yield block, buffers.pop(var.blocks.index(block), aligned_empty(block.shape, var.target_dtype))


def _host_blocks(files: _Files, var: VariablePlan, stats: ExecuteStats) -> Iterator[tuple[Block, np.ndarray]]:
    if var.strategy == "span":
        yield from _read_spans(files, var, stats)
        return
    read = _read_direct if var.strategy == "direct" else _read_h5py
    for block in var.blocks:
        yield block, read(files, var, block, stats)


def execute_plan(
    plan: LoadPlan,
    shardings: Mapping[str, jax.sharding.Sharding],
    devices: Mapping[int, Any],
    on_variable: Callable[[VariablePlan, jax.Array], None],
    *,
    progress: ProgressBar | None = None,
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
    try:
        for var in plan.variables:
            try:
                per_device: list[jax.Array] = []
                for block, host in _host_blocks(files, var, stats):
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
        files.close()
        if progress is not None:
            progress.close()
    return stats
