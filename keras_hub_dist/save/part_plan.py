"""Which process uploads which part of each weights file: the plan of a save
into object storage.

A multipart upload's part is uploaded whole by one process, so all of its
bytes must be on that process. Parts are fixed 64 MiB ranges of the file
(one checksum chunk each, `storage.part_uploads`); the write plan
(`save.write_plan`: each block written once, by a device that holds it)
says which process writes which bytes. Here, pure functions over those
plans (no device, no file) decide per part:

- its **owner**, the process that uploads it: the only process that writes
  bytes of it, if there is one (nothing moves), else the one with the fewest
  bytes to upload so far (its bytes are combined anyway), so each process
  uploads about its share and a process-contiguous layout moves nothing;
- whether it is **mixed**: other processes write bytes of it too. A mixed
  part's bytes are combined on its owner before the upload: every process
  fills a zeroed buffer with its own bytes of the part, and the buffers are
  summed over the processes (the bytes are disjoint, so the sum is the
  part), slice by slice (`save.remote_save`);
- **when** it can be combined: once the walk (every process walks every
  value in the same order) has written the last value with bytes in it up
  to the part's end. Keras's walk is about the file's order, not exactly:
  HDF5 gathers small datasets (norms) into blocks allocated earlier, so a
  part can hold a small value written long after the part's big ones.

The skeleton's bytes (HDF5 metadata around the values) are written by each
part's owner only, so every byte of a mixed part has exactly one writer.

Example:

```python
plans = [plan_save(requests, process_index=p, process_count=2) for p in range(2)]
parts = plan_parts({"w.h5": size}, plans, part_bytes=64 << 20)
parts["w.h5"].owners[0], parts["w.h5"].mixed, parts["w.h5"].last_value
```
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist.save.write_plan import SavePlan

__all__ = ["FileParts", "plan_parts", "plan_step_parts", "run_offsets"]


@dataclass(frozen=True)
class FileParts:
    """The parts of one weights file.

    Attributes:
        size: The file's length.
        part_bytes: Bytes per part but the last.
        owners: Per part (index `number - 1`), the process that uploads it.
        mixed: Numbers of the parts several processes write bytes of.
        last_value: Part number -> the walk index of the last value with
            bytes in it (parts holding only the file's own bytes: none).
        bytes_by_process: Per part, bytes each process writes (values only).
    """

    size: int
    part_bytes: int
    owners: tuple[int, ...]
    mixed: frozenset[int]
    last_value: Mapping[int, int]
    bytes_by_process: np.ndarray

    def owned_by(self, process: int) -> frozenset[int]:
        """The part numbers `process` uploads."""
        return frozenset(k + 1 for k, owner in enumerate(self.owners) if owner == process)


def _add_runs(counts: np.ndarray, offsets: np.ndarray, length: int, part_bytes: int) -> None:
    """Adds runs `[offset, offset + length)` to `counts` (bytes per part)."""
    if not len(offsets) or not length:
        return
    if length <= part_bytes:  # each run spans at most two parts
        first = offsets // part_bytes
        head = np.minimum(length, (first + 1) * part_bytes - offsets)
        np.add.at(counts, first, head)
        tail = length - head
        spill = tail > 0
        np.add.at(counts, first[spill] + 1, tail[spill])
        return
    for offset in offsets.tolist():
        position, end = offset, offset + length
        while position < end:
            part = position // part_bytes
            step = min(end, (part + 1) * part_bytes) - position
            counts[part] += step
            position += step


def run_offsets(runs) -> np.ndarray:
    """The file offset of every run of `runs` (a `ByteRuns`), in C order."""
    offsets = np.array([runs.offset], dtype=np.int64)
    for count, stride in zip(runs.counts, runs.strides):
        offsets = np.add.outer(offsets, np.arange(count, dtype=np.int64) * stride).reshape(-1)
    return offsets


def plan_parts(
    sizes: Mapping[str, int], plans: Sequence[SavePlan], part_bytes: int
) -> dict[str, FileParts]:
    """Owners, mixed parts and their last values, of every file (module doc).

    Args:
        sizes: File -> length, in the order the walk writes them.
        plans: Every process's `SavePlan` (index = process), of every
            weights set in walk order, concatenated per process (each
            lists every value, with its blocks or none).
        part_bytes: Bytes per part but the last.
    """
    writes = (
        (process, value.file, index, block.runs)
        for process, plan in enumerate(plans)
        for index, value in enumerate(plan.values)  # walk order, the same in every plan
        for block in value.blocks
    )
    return plan_step_parts(sizes, writes, len(plans), part_bytes)


def plan_step_parts(
    sizes: Mapping[str, int], writes: Iterable[tuple[int, str, int, Any]], processes: int, part_bytes: int
) -> dict[str, FileParts]:
    """`plan_parts` over any sequence of steps that every process takes in
    the same order (the Keras walk's values, or the Hugging Face export's
    slabs in file order, `save.hf_part_plan`).

    Args:
        sizes: File -> length, in the order the steps write them.
        writes: `(process, file, step index, byte runs)` of every write of
            every process (`last_value` is then the last step index).
        processes: Processes of the job.
        part_bytes: Bytes per part but the last.
    """
    counts = {f: np.zeros((processes, max(1, -(-s // part_bytes))), np.int64) for f, s in sizes.items()}
    last_value: dict[str, dict[int, int]] = {f: {} for f in sizes}
    for process, file, index, runs in writes:
        if not runs.num_runs:
            continue
        offsets = run_offsets(runs)
        _add_runs(counts[file][process], offsets, runs.run_bytes, part_bytes)
        first = int(offsets.min()) // part_bytes
        last = (int(offsets.max()) + runs.run_bytes - 1) // part_bytes
        touched = last_value[file]
        for part in range(first + 1, last + 2):
            touched[part] = max(touched.get(part, -1), index)
    load = [0] * processes
    out = {}
    for file, size in sizes.items():
        table = counts[file]
        owners = []
        for k in range(table.shape[1]):
            writers = [p for p in range(processes) if table[p, k]]
            # One writer: it uploads, nothing moves. Several: the part is
            # combined anyway, so the least loaded uploads it (balance).
            candidates = writers if len(writers) == 1 else range(processes)
            owner = min(candidates, key=lambda p: (load[p], p))
            start = k * part_bytes
            load[owner] += min(size, start + part_bytes) - start
            owners.append(owner)
        mixed = frozenset(
            k + 1 for k in range(table.shape[1])
            if any(table[p, k] for p in range(processes) if p != owners[k])
        )
        out[file] = FileParts(size, part_bytes, tuple(owners), mixed, last_value[file], table)
    return out
