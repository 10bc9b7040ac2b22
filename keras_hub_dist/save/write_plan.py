"""The write plan: which process writes which block of which value, where.

Pure functions over shapes, the devices that hold each block and the file
layout: nothing here reads a weight, touches a device or a file, so a plan
can be built and checked with a fake device set in a test.

Every distinct block of a saved value is written exactly once, by one of the
devices that hold it: a block held by several devices (a replicated value,
or a value replicated over the batch axis) goes to the process that has the
fewest bytes to write so far, so replicated weights spread over the
processes instead of all landing on process 0. Every process computes the
same global assignment (same inputs, same order) and keeps its own part.
A block's bytes in the file are the strided runs of a C-order array
(`formats.base.byte_runs`), as for reading.

Example:

```python
request = SaveRequest("vars/0", "embeddings", (8, 4), np.float32, "w.h5", 2048,
                      {device: index for device, index in ...})
plan = plan_save([request], process_index=0, process_count=2)
plan.values[0].blocks   # the blocks process 0 writes, with their byte runs
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist.formats.base import ByteRuns, Index, byte_runs

__all__ = ["BlockWrite", "SavePlan", "SaveRequest", "ValueWrite", "block_owners", "plan_save"]


@dataclass(frozen=True)
class SaveRequest:
    """One saved value and where it goes.

    Attributes:
        name: Dataset name in the weights file.
        path: The Keras variable path (for messages).
        shape: Global shape.
        dtype: Dtype written (the value's own).
        file: The weights file holding the dataset.
        offset: Byte offset of the dataset's data in `file`.
        device_indices: Device -> the block (`((start, stop), ...)`) it holds,
            for every device of the value's sharding (devices need `id` and
            `process_index`); `None` for a value on the host (written by
            process 0).
    """

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    file: str
    offset: int
    device_indices: Mapping[Any, Index] | None


@dataclass(frozen=True)
class BlockWrite:
    """One block this process writes: from `device_id` (`None`: host value)."""

    index: Index
    device_id: int | None
    runs: ByteRuns

    @property
    def nbytes(self) -> int:
        return self.runs.nbytes


@dataclass(frozen=True)
class ValueWrite:
    """What this process writes of one value."""

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    file: str
    blocks: tuple[BlockWrite, ...]
    offset: int = 0  # of the value's first byte in `file`

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


@dataclass(frozen=True)
class SavePlan:
    """The plan of one process, plus every process's byte total."""

    values: tuple[ValueWrite, ...]
    process_index: int
    bytes_per_process: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values)


def _full_index(shape: Sequence[int]) -> Index:
    return tuple((0, int(d)) for d in shape)


def block_owners(
    device_indices: Mapping[Any, Index], itemsize: int, load: list[int]
) -> list[tuple[Index, Any]]:
    """Each distinct block of a value with the device that writes it: one
    of its holders, on the process with the fewest bytes so far (`load`,
    bytes per process, is updated). Same inputs, same answer on every
    process."""
    holders: dict[Index, list[Any]] = {}
    for device, index in device_indices.items():
        holders.setdefault(index, []).append(device)
    owners = []
    for index in sorted(holders):
        nbytes = math.prod(b - a for a, b in index) * itemsize
        owner = min(holders[index], key=lambda d: (load[d.process_index], d.process_index, d.id))
        load[owner.process_index] += nbytes
        owners.append((index, owner))
    return owners


def plan_save(
    requests: Sequence[SaveRequest],
    *,
    process_index: int,
    process_count: int,
) -> SavePlan:
    """Plans which blocks process `process_index` writes.

    Args:
        requests: Every saved value, in the same order on every process.
        process_index: The process to plan for.
        process_count: Processes in the job.

    Returns:
        A `SavePlan`: each distinct block of every value is in exactly one
        process's plan.
    """
    load = [0] * process_count
    values = []
    for request in requests:
        itemsize = np.dtype(request.dtype).itemsize
        mine = []
        if request.device_indices is None:
            index = _full_index(request.shape)
            runs = byte_runs(request.shape, itemsize, index, request.offset)
            load[0] += runs.nbytes
            if process_index == 0:
                mine.append(BlockWrite(index, None, runs))
        else:
            for index, owner in block_owners(request.device_indices, itemsize, load):
                if owner.process_index == process_index:
                    runs = byte_runs(request.shape, itemsize, index, request.offset)
                    mine.append(BlockWrite(index, owner.id, runs))
        values.append(
            ValueWrite(
                request.name, request.path, tuple(request.shape),
                np.dtype(request.dtype), request.file, tuple(mine), request.offset,
            )
        )
    return SavePlan(tuple(values), process_index, tuple(load))
