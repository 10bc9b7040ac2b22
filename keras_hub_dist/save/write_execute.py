"""Executes a process's part of a `SavePlan`: positioned writes of its blocks.

The thin second phase of saving. For each saved value, each block this
process owns is taken from the device that holds it (`_compat.host_array`:
on CPU a view of the device buffer, no copy; on accelerators one block's
copy, never cached in the array) and written at its byte runs in the
preallocated dataset (`formats.keras_h5_writer`):

- `"direct"`: each block's runs with one `pwritev` each, a block at a time,
  when runs are long (or there is one per block);
- `"slabs"`, for a sink that must be written in file order (an object
  store's parts, `storage.part_uploads`): the value is walked in slabs of
  whole leading-axis rows (`SLAB_BYTES`, contiguous in the file) and each
  slab's runs of every local block are written merged in file order, so at
  most the parts a slab spans are being filled at once (a block split along
  a later axis otherwise touches every part of the value). Off CPU each
  block's rows in the slab are copied to the host alone;
- `"scatter"`: the runs of all the value's local blocks merged in file order,
  so each contiguous stretch of the file is one `pwritev` whose iovecs point
  into the blocks (a kernel split along its last axis has a short run per
  row and device; on one host the rows of all devices are back to back).
  On accelerators this holds the process's blocks of one value on the host
  at once, so it is only used up to `SCATTER_MAX_HOST_BYTES` there.

No device computes anything and no value is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import ByteRuns, byte_runs
from keras_hub_dist.save.write_plan import BlockWrite, ValueWrite

__all__ = ["WriteStats", "file_order_slabs", "slab_ends", "write_value"]

# Runs at least this long are written one `pwritev` each; shorter ones are
# merged across blocks (as `load.block_plan.DIRECT_MIN_RUN_BYTES` for reads).
DIRECT_MIN_RUN_BYTES = 256 * 1024
# Off CPU, the most host memory scatter writes of one value may hold.
SCATTER_MAX_HOST_BYTES = 256 << 20
# File-order writes ("slabs"): the file bytes of one slab of leading rows,
# by default (a sink in file order says its own: a fraction of its parts).
SLAB_BYTES = 16 << 20


@dataclass
class WriteStats:
    """What this process wrote."""

    bytes_written: int = 0
    write_calls: int = 0
    blocks: int = 0


def _strategy(blocks: tuple[BlockWrite, ...], on_cpu: bool) -> str:
    runs = [b.runs for b in blocks if b.runs.num_runs]
    if len(runs) < 2 or all(r.num_runs <= 1 for r in runs):
        return "direct"
    if min(r.run_bytes for r in runs) >= DIRECT_MIN_RUN_BYTES:
        return "direct"
    if not on_cpu and sum(r.nbytes for r in runs) > SCATTER_MAX_HOST_BYTES:
        return "direct"
    return "scatter"


def _block_values(value: Any, plan: ValueWrite) -> Iterator[tuple[BlockWrite, np.ndarray]]:
    """Each block of the plan with its host values, C-contiguous, in the
    value's dtype."""
    if any(b.device_id is None for b in plan.blocks):
        host = np.ascontiguousarray(np.asarray(value))
        for block in plan.blocks:
            yield block, host[tuple(slice(a, b) for a, b in block.index)]
        return
    shards = {shard.device.id: shard for shard in value.addressable_shards}
    for block in plan.blocks:
        shard = shards.get(block.device_id)
        if shard is None:
            raise ValueError(
                f"Expected device {block.device_id} to hold block {block.index} "
                f"of the value. Received: a value on devices {sorted(shards)} "
                "(its sharding changed since the plan was made)."
            )
        yield block, np.ascontiguousarray(_compat.host_array(shard.data))


def _check(plan: ValueWrite, values: np.ndarray, block: BlockWrite) -> np.ndarray:
    shape = tuple(b - a for a, b in block.index)
    if values.shape != shape or values.dtype != plan.dtype:
        raise ValueError(
            f"Expected block {block.index} of shape {shape} and dtype "
            f"{plan.dtype}. Received: shape {values.shape}, dtype {values.dtype}."
        )
    return values


def write_value(
    plan: ValueWrite, value: Any, files: host_io.FileDescriptors, stats: WriteStats, *, on_cpu: bool
) -> None:
    """Writes this process's blocks of one saved value.

    Args:
        plan: The value's part of this process's `SavePlan`.
        value: The value Keras saves (a `jax.Array`, or a host array).
        files: Open weights files.
        stats: Updated with the bytes and calls made.
        on_cpu: Whether the devices are CPUs (host views cost no memory).
    """
    if not plan.blocks:
        return
    fd = files(plan.file)
    if getattr(files, "in_file_order", False):
        for _, writes in file_order_slabs(plan, value, on_cpu, files.slab_bytes):
            for offset, iovecs in writes:
                stats.write_calls += files.pwritev(fd, iovecs, offset)
                stats.bytes_written += sum(len(v) for v in iovecs)
        stats.blocks += len(plan.blocks)
        return
    if _strategy(plan.blocks, on_cpu) == "direct":
        for block, values in _block_values(value, plan):
            stats.write_calls += host_io.write_runs(files, fd, block.runs, _check(plan, values, block))
            stats.bytes_written += block.nbytes
            stats.blocks += 1
            del values
        return
    blocks = list(_block_values(value, plan))
    views = [
        memoryview(_check(plan, values, block).reshape(-1).view(np.uint8))
        for block, values in blocks
    ]
    runs: list[ByteRuns] = [block.runs for block, _ in blocks]
    offsets, lengths, owners, sources = host_io.sorted_pieces(runs)
    for i, j in host_io.contiguous_groups(offsets, lengths):
        iovecs = [views[owners[k]][sources[k] : sources[k] + lengths[k]] for k in range(i, j)]
        stats.write_calls += files.pwritev(fd, iovecs, offsets[i])
        stats.bytes_written += sum(lengths[i:j])
    stats.blocks += len(blocks)


def slab_ends(plan: ValueWrite, slab_bytes: int = SLAB_BYTES) -> list[int]:
    """Where each slab of `file_order_slabs` ends in the file (every
    process has the same, blocks or none)."""
    if not plan.shape:
        return [plan.offset + plan.dtype.itemsize]
    row_bytes = math.prod(plan.shape[1:]) * plan.dtype.itemsize
    rows = max(1, slab_bytes // max(1, row_bytes))
    return [plan.offset + min(plan.shape[0], first + rows) * row_bytes for first in range(0, plan.shape[0], rows)]


def file_order_slabs(
    plan: ValueWrite, value: Any, on_cpu: bool, slab_bytes: int = SLAB_BYTES
) -> Iterator[tuple[int, list[tuple[int, list[memoryview]]]]]:
    """The `"slabs"` strategy (module doc): per slab of leading rows (about
    `slab_bytes`), where it ends in the file (`slab_ends`) and this
    process's writes of it, `(offset, iovecs)` in file order (none where it
    holds no block)."""
    ends = slab_ends(plan, slab_bytes)
    if not plan.shape or not plan.blocks:
        for end in ends:
            writes = []
            if plan.blocks:  # a scalar
                values = np.ascontiguousarray(np.asarray(value)).reshape(1)
                writes = [(plan.offset, [memoryview(values.view(np.uint8))])]
            yield end, writes
        return
    itemsize = plan.dtype.itemsize
    row_bytes = max(1, math.prod(plan.shape[1:]) * itemsize)
    rows = max(1, slab_bytes // row_bytes)
    host = None
    shards: dict[int, Any] = {}
    if any(b.device_id is None for b in plan.blocks):
        host = np.ascontiguousarray(np.asarray(value))
    else:
        shards = {shard.device.id: shard.data for shard in value.addressable_shards}
    for first, end in zip(range(0, plan.shape[0], rows), ends):
        last = min(plan.shape[0], first + rows)
        views, runs = [], []
        for block in plan.blocks:
            (start, stop), rest = block.index[0], block.index[1:]
            lo, hi = max(start, first), min(stop, last)
            if lo >= hi:
                continue
            index = ((lo, hi),) + rest
            if host is not None:
                values = host[tuple(slice(a, b) for a, b in index)]
            elif on_cpu:  # a view of the device buffer
                values = _compat.host_array(shards[block.device_id])[lo - start : hi - start]
            else:  # only these rows cross to the host
                values = _compat.host_array(shards[block.device_id][lo - start : hi - start])
            values = _check(plan, np.ascontiguousarray(values), BlockWrite(index, block.device_id, block.runs))
            views.append(memoryview(values.reshape(-1).view(np.uint8)))
            runs.append(byte_runs(plan.shape, itemsize, index, plan.offset))
        writes = []
        if runs:
            offsets, lengths, owners, sources = host_io.sorted_pieces(runs)
            for i, j in host_io.contiguous_groups(offsets, lengths):
                writes.append((offsets[i], [views[owners[k]][sources[k] : sources[k] + lengths[k]] for k in range(i, j)]))
        yield end, writes
