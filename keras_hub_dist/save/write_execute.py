"""Executes a process's part of a `SavePlan`: positioned writes of its blocks.

The thin second phase of saving. For each saved value, each block this
process owns is taken from the device that holds it (`_compat.host_array`:
on CPU a view of the device buffer, no copy; on accelerators one block's
copy, never cached in the array) and written at its byte runs in the
preallocated dataset (`formats.keras_h5_writer`):

- `"direct"`: each block's runs with one `pwritev` each, a block at a time,
  when runs are long (or there is one per block);
- `"scatter"`: the runs of all the value's local blocks merged in file order,
  so each contiguous stretch of the file is one `pwritev` whose iovecs point
  into the blocks (a kernel split along its last axis has a short run per
  row and device; on one host the rows of all devices are back to back).
  On accelerators this holds the process's blocks of one value on the host
  at once, so it is only used up to `SCATTER_MAX_HOST_BYTES` there.

No device computes anything and no value is gathered.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import ByteRuns
from keras_hub_dist.save.write_plan import BlockWrite, ValueWrite

__all__ = ["WriteStats", "write_value"]

# Runs at least this long are written one `pwritev` each; shorter ones are
# merged across blocks (as `load.block_plan.DIRECT_MIN_RUN_BYTES` for reads).
DIRECT_MIN_RUN_BYTES = 256 * 1024
# Off CPU, the most host memory scatter writes of one value may hold.
SCATTER_MAX_HOST_BYTES = 256 << 20


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
