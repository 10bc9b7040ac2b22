"""The order a Hugging Face export into object storage writes its bytes in:
the files' own byte order, slab by slab (pure functions, no device, no file).

The Keras-format save into a bucket (`save.remote_save`) writes its values
in Keras's walk order, which is about the order of the HDF5 file, so each
64 MiB part fills soon after it opens. A safetensors checkpoint is not in
the model's order at all: each file holds its tensors sorted by name
(`layers.0`, `layers.1`, `layers.10`, ...; `mlp` before `self_attn`), and
one variable can feed several tensors far apart (an expert bank, one tensor
per expert). Written in walk order, every part would stay open until the
walk came back to it: the part buffers would hold most of the model.

So the export walks the **files**, not the model: each write of a block
(`save.hf_export.plan_blocks`: a device's block of a variable, through one
piece of one tensor, transposed or cast as the local export does) is cut
into **steps** of whole outermost rows of the tensor, each spanning at most
`slab_bytes` of the file (a quarter part), and every process takes the
steps of every process in one order: by file, then by the step's first
byte. A process writes its own steps and skips the others' (but keeps the
order: mixed parts are combined after their last step, collectively).
The parts open at once are then those the steps around the current file
position span: at most about two parts plus one per file a tensor piece
straddles (`peak_open_parts`, checked in the tests for the meshes the suite
runs, and bounded at run time by `PartUploads`' `max_buffers`).

Example:

```python
plans = [plan_blocks(mapping, layout, "", indices, process_index=p, process_count=2)[0] for p in range(2)]
steps = plan_steps(plans, [f.name for f in layout.files], slab_bytes=16 << 20)
parts = plan_step_parts(sizes, ((s.process, s.file, i, s.runs) for i, s in enumerate(steps)), 2, 64 << 20)
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from keras_hub_dist.formats.base import ByteRuns
from keras_hub_dist.formats.pieces import BlockWrite
from keras_hub_dist.save.part_plan import run_offsets

__all__ = ["Step", "peak_open_parts", "plan_steps", "row_window", "sub_write", "unwritten"]


@dataclass(frozen=True)
class Step:
    """Rows `first:stop` of one write of one block, of one process.

    Attributes:
        process: The process that writes it.
        dataset: The variable's dataset name (`save.hf_mapping`).
        block: Index of the block in that process's plan of the dataset.
        write: Index of the write in the block's writes.
        file: The safetensors file it lands in.
        first: First outermost row of the write.
        stop: One past its last.
        runs: Its byte runs in the file.
    """

    process: int
    dataset: str
    block: int
    write: int
    file: str
    first: int
    stop: int
    runs: ByteRuns

    @property
    def start(self) -> int:
        return self.runs.offset


def _rows_per_step(write: BlockWrite, slab_bytes: int) -> int:
    """Outermost rows of `write` whose span in the file is at most
    `slab_bytes` (at least one)."""
    if not write.shape:
        return 1
    return max(1, slab_bytes // max(1, write.file_steps[0]))


def sub_write(write: BlockWrite, first: int, stop: int) -> BlockWrite:
    """Rows `first:stop` of `write`, as a write of the block sliced by
    `row_window(write, first, stop)` along its dimension `write.dims[0]`."""
    if not write.shape:
        return write
    dim = write.dims[0]
    start = list(write.start)
    start[dim] = 0  # the slice begins at the first row's element
    return replace(
        write,
        start=tuple(start),
        shape=(stop - first,) + write.shape[1:],
        file_offset=write.file_offset + first * write.file_steps[0],
    )


def row_window(write: BlockWrite, first: int, stop: int) -> tuple[int, int, int] | None:
    """`(block dimension, start, stop)`: the slice of the block that rows
    `first:stop` of `write` read (the elements of every inner atom along
    the same dimension included); `None`: the whole block (a scalar)."""
    if not write.shape:
        return None
    dim = write.dims[0]
    low = write.start[dim] + first * write.steps[0]
    extent = (stop - first - 1) * write.steps[0] + 1
    extent += sum((size - 1) * step for size, d, step in zip(write.shape[1:], write.dims[1:], write.steps[1:]) if d == dim)
    return dim, low, low + extent


def plan_steps(
    plans: Sequence[Mapping[str, Sequence[object]]], file_order: Sequence[str], slab_bytes: int
) -> list[Step]:
    """Every process's steps, in the order every process takes them.

    Args:
        plans: Per process, dataset -> its `BlockPlan`s there
            (`save.hf_export.plan_blocks` with directory `""`, so each
            write names its file).
        file_order: The files, in the order they are written.
        slab_bytes: The most file bytes one step spans (rows permitting).

    Returns:
        The steps, by file, then first byte (then process, dataset, block,
        write, row: a total order, the same on every process).
    """
    rank = {name: i for i, name in enumerate(file_order)}
    steps = []
    for process, datasets in enumerate(plans):
        for dataset, blocks in datasets.items():
            for b, block in enumerate(blocks):
                for w, (file, write, _) in enumerate(block.writes):
                    rows = write.shape[0] if write.shape else 1
                    step = _rows_per_step(write, slab_bytes)
                    for first in range(0, rows, step):
                        stop = min(rows, first + step)
                        runs = write.runs(first, stop) if write.shape else write.runs()
                        steps.append(Step(process, dataset, b, w, file, first, stop, runs))
    steps.sort(key=lambda s: (rank[s.file], s.start, s.process, s.dataset, s.block, s.write, s.first))
    return steps


def peak_open_parts(steps: Sequence[Step], process: int, part_bytes: int) -> int:
    """The most parts `process` holds a buffer for at once, taking the
    steps in order: a part is open from the first step of `process` that
    writes into it until the last step of any process that does (then it is
    complete, or combined). Uploads in flight come on top (`PartUploads`)."""
    first_touch: dict[tuple[str, int], int] = {}
    last_touch: dict[tuple[str, int], int] = {}
    for index, step in enumerate(steps):
        if not step.runs.num_runs:
            continue
        low = step.runs.offset // part_bytes
        high = (step.runs.offset + _span(step.runs) - 1) // part_bytes
        for part in range(low, high + 1):
            key = (step.file, part)
            last_touch[key] = index
            if step.process == process:
                first_touch.setdefault(key, index)
    events = sorted([(first_touch[k], 1) for k in first_touch] + [(last_touch[k], -1) for k in first_touch],
                    key=lambda e: (e[0], -e[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def _span(runs: ByteRuns) -> int:
    """Bytes from the first run's start to the last run's end."""
    return sum((c - 1) * s for c, s in zip(runs.counts, runs.strides)) + runs.run_bytes


def unwritten(steps: Sequence[Step], sizes: Mapping[str, int], headers: Mapping[str, int]) -> dict[str, list[tuple[int, int]]]:
    """Per file, the byte ranges `[start, stop)` past its header that no
    step of any process writes: zeros in the file, which the local save
    leaves as holes (a PEFT adapter's ranks padded to the largest, the
    blocks off `lora_B`'s diagonal: `save.lora_adapter`) and a part's owner
    writes itself. A file whose every byte a step writes (any checkpoint)
    costs one sum and has none.

    Args:
        steps: Every process's steps (`plan_steps`).
        sizes: File -> length.
        headers: File -> the length of its header (not written by steps).
    """
    written = dict.fromkeys(sizes, 0)
    for step in steps:
        written[step.file] += step.runs.nbytes
    out: dict[str, list[tuple[int, int]]] = {}
    for name, size in sizes.items():
        if written[name] + headers[name] >= size:
            continue
        # The written runs sorted by start (with the header's): a hole is
        # where a run starts past the furthest end before it. Memory: the
        # runs, not the file.
        runs = [(run_offsets(s.runs), s.runs.run_bytes) for s in steps if s.file == name and s.runs.num_runs]
        starts = np.concatenate([np.zeros(1, np.int64)] + [offsets for offsets, _ in runs])
        ends = np.concatenate([np.full(1, headers[name], np.int64)] + [offsets + length for offsets, length in runs])
        order = np.argsort(starts, kind="stable")
        reached = np.maximum.accumulate(ends[order])
        after = np.append(starts[order][1:], size)
        gaps = np.flatnonzero(after > reached)
        out[name] = list(zip(reached[gaps].tolist(), after[gaps].tolist()))
    return out
