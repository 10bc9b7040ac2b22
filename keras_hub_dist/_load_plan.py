"""Load planning: which bytes of the weights file go to which device.

Pure functions over shapes, partition specs, a device grid and dataset
offsets: nothing here reads a weight or touches a device, so a plan can be
built and checked with a fake mesh (`FakeMesh`) in a test, and every process
of a multi-host job plans only what its own devices hold.

For each variable the plan groups this process's devices by the block of the
global array they hold (a fully replicated variable is one block held by all
local devices): each block is read from disk once per process and copied to
the other devices that hold it. Each block's bytes in the file are an exact
set of strided runs (`ByteRuns`); a process reads exactly the runs of its own
blocks, each byte once. The executor reads them in one of three ways:

- `"direct"`: each block's runs straight into its buffer (one `os.preadv`
  per run); used when runs are long (or there is one per block), and blocks
  can be read in parallel.
- `"scatter"`: the runs of all local blocks merged in file order, so each
  contiguous stretch of the file is read by one `os.preadv` whose iovecs
  point into the blocks' buffers (no scratch buffer, no copy); used when runs
  are short, e.g. a kernel split along its last axis (a run per row).
- `"h5py"`: a hyperslab read through h5py, for chunked/compressed datasets
  (Keras never writes them, but other tools might).

Example:

```python
mesh = FakeMesh({"batch": 2, "model": 4})
plan = plan_load([VariableRequest("emb", dataset, ("model", None), np.float32)], mesh)
plan.variables[0].blocks[0].device_ids   # (0, 4): both batch rows hold rows 0:N/4
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from keras_hub_dist import _sharding
from keras_hub_dist._h5_index import DatasetInfo

__all__ = [
    "Block",
    "ByteRuns",
    "FakeDevice",
    "FakeMesh",
    "LoadPlan",
    "VariablePlan",
    "VariableRequest",
    "block_indices",
    "byte_runs",
    "plan_load",
]

AxisEntry = str | tuple[str, ...] | None
Index = tuple[tuple[int, int], ...]

# Runs at least this long are read one `preadv` each (blocks in parallel);
# shorter runs are merged across blocks into few large scatter reads.
DIRECT_MIN_RUN_BYTES = 256 * 1024


@dataclass(frozen=True)
class FakeDevice:
    """A stand-in for a `jax.Device` in planning tests."""

    id: int
    process_index: int = 0


class FakeMesh:
    """A device grid with axis names, without devices: for planning tests.

    Args:
        axis_sizes: `{axis_name: size}` in mesh order.
        num_processes: Devices are split into this many processes in order
            (device `i` belongs to process `i * num_processes // n`), like
            hosts owning consecutive devices.
    """

    def __init__(self, axis_sizes: Mapping[str, int], num_processes: int = 1) -> None:
        self.axis_names = tuple(axis_sizes)
        shape = tuple(int(s) for s in axis_sizes.values())
        n = math.prod(shape)
        if num_processes < 1 or n % num_processes:
            raise ValueError(
                f"Expected num_processes to divide the {n} devices. "
                f"Received: num_processes={num_processes}."
            )
        devices = [FakeDevice(i, i * num_processes // n) for i in range(n)]
        self.devices = np.empty(n, dtype=object)
        self.devices[:] = devices
        self.devices = self.devices.reshape(shape)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self.devices.shape)


@dataclass(frozen=True)
class ByteRuns:
    """The bytes of one block inside the file: `prod(counts)` runs, C order.

    Run `k` (a multi-index over `counts`) starts at
    `offset + sum(k_i * strides_i)` and is `run_bytes` long; the runs land in
    the block's buffer one after another.
    """

    offset: int
    run_bytes: int
    counts: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def num_runs(self) -> int:
        return math.prod(self.counts) if self.run_bytes else 0

    @property
    def nbytes(self) -> int:
        return self.num_runs * self.run_bytes

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """Yields `(file_offset, length)` per run, in buffer order."""
        if not self.run_bytes:
            return
        for k in np.ndindex(*self.counts):
            yield self.offset + sum(i * s for i, s in zip(k, self.strides)), self.run_bytes



def block_indices(
    shape: Sequence[int], spec: Sequence[AxisEntry], mesh: Any
) -> dict[Any, Index]:
    """Device -> `((start, stop), ...)` of the block it holds.

    Follows `jax.sharding.NamedSharding`: a dimension split over axes
    `(a, b)` is cut into `size(a) * size(b)` equal parts, `a` major.
    The spec must divide the shape (see `_sharding.validate_spec`).
    """
    shape = tuple(int(d) for d in shape)
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    names = tuple(mesh.axis_names)
    grid = np.asarray(mesh.devices)
    sizes = dict(zip(names, grid.shape))
    out: dict[Any, Index] = {}
    for coords in np.ndindex(*grid.shape):
        index = []
        for dim, entry in zip(shape, spec):
            axes = _sharding.entry_axes(entry)
            parts = math.prod(sizes[a] for a in axes)
            k = 0
            for a in axes:
                k = k * sizes[a] + coords[names.index(a)]
            step = dim // parts
            index.append((k * step, (k + 1) * step))
        out[grid[coords]] = tuple(index)
    return out


def byte_runs(shape: Sequence[int], itemsize: int, index: Index, offset: int) -> ByteRuns:
    """The strided byte runs of block `index` of a C-order array at `offset`."""
    shape = tuple(int(d) for d in shape)
    if not shape:
        return ByteRuns(offset, itemsize, (), ())
    if any(stop <= start for start, stop in index):
        return ByteRuns(offset, 0, (), ())
    strides = [itemsize * math.prod(shape[i + 1 :]) for i in range(len(shape))]
    # Every dimension after the last partial one is taken whole, so one run
    # spans the partial dimension's slice times everything after it.
    partial = [i for i, (start, stop) in enumerate(index) if (start, stop) != (0, shape[i])]
    last = partial[-1] if partial else -1
    if last < 0:
        return ByteRuns(offset, itemsize * math.prod(shape), (), ())
    start_offset = offset + sum(index[i][0] * strides[i] for i in range(last + 1))
    run_bytes = (index[last][1] - index[last][0]) * strides[last]
    counts, run_strides = [], []
    for i in range(last):
        count = index[i][1] - index[i][0]
        if count > 1:
            counts.append(count)
            run_strides.append(strides[i])
    return ByteRuns(start_offset, run_bytes, tuple(counts), tuple(run_strides))


@dataclass(frozen=True)
class Block:
    """One distinct block of a variable on this process.

    Attributes:
        index: `((start, stop), ...)` of the block in the global array.
        device_ids: The local devices holding it, in mesh order; the block is
            read once and copied to the others.
        runs: Its bytes in the file (`None` for non-contiguous datasets).
    """

    index: Index
    device_ids: tuple[int, ...]
    runs: ByteRuns | None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.index)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.index)


@dataclass(frozen=True)
class VariablePlan:
    """How one variable is read and placed on this process.

    Attributes:
        path: Keras variable path.
        shape: Global shape.
        source_dtype: Dtype on disk.
        target_dtype: Dtype of the variable (each block is cast on the host).
        spec: Partition spec (one entry per dimension).
        dataset: Where the bytes are.
        blocks: The distinct local blocks.
        strategy: `"direct"`, `"scatter"` or `"h5py"` (see the module doc).
        read_bytes: Bytes this process reads from the file for the variable
            (exactly the bytes of its blocks, each once).
    """

    path: str
    shape: tuple[int, ...]
    source_dtype: np.dtype
    target_dtype: np.dtype
    spec: tuple[AxisEntry, ...]
    dataset: DatasetInfo
    blocks: tuple[Block, ...]
    strategy: str
    read_bytes: int

    @property
    def replicated(self) -> bool:
        """Whether every local device holds the whole variable."""
        return len(self.blocks) == 1 and self.blocks[0].shape == self.shape

    def device_bytes(self) -> dict[int, int]:
        """Target-dtype bytes this variable puts on each local device."""
        out = {}
        for block in self.blocks:
            nbytes = math.prod(block.shape) * self.target_dtype.itemsize
            for d in block.device_ids:
                out[d] = out.get(d, 0) + nbytes
        return out


@dataclass(frozen=True)
class LoadPlan:
    """The plan of one process: every variable, in load order."""

    variables: tuple[VariablePlan, ...]
    process_index: int
    axis_sizes: dict[str, int]

    @property
    def read_bytes(self) -> int:
        return sum(v.read_bytes for v in self.variables)

    def device_bytes(self) -> dict[int, int]:
        """Final bytes per local device once every variable is placed."""
        out: dict[int, int] = {}
        for v in self.variables:
            for d, b in v.device_bytes().items():
                out[d] = out.get(d, 0) + b
        return out


@dataclass(frozen=True)
class VariableRequest:
    """What the planner needs to know about one variable."""

    path: str
    dataset: DatasetInfo
    spec: tuple[AxisEntry, ...]
    target_dtype: Any


def _choose_strategy(dataset: DatasetInfo, blocks: Sequence[Block]) -> tuple[str, int]:
    if not dataset.contiguous:
        return "h5py", sum(math.prod(b.shape) * dataset.dtype.itemsize for b in blocks)
    needed = sum(b.runs.nbytes for b in blocks)
    shortest = min((b.runs.run_bytes for b in blocks if b.runs.num_runs), default=0)
    if all(b.runs.num_runs <= 1 for b in blocks) or shortest >= DIRECT_MIN_RUN_BYTES:
        return "direct", needed
    return "scatter", needed


def plan_load(
    requests: Sequence[VariableRequest],
    mesh: Any,
    *,
    process_index: int = 0,
) -> LoadPlan:
    """Plans what process `process_index` reads and where each block goes.

    Args:
        requests: One per variable, in load order. Specs must already be
            validated (every split dimension divisible).
        mesh: A `jax.sharding.Mesh` or `FakeMesh` (anything with
            `axis_names` and a `devices` grid whose items have `id` and
            `process_index`).
        process_index: The process to plan for: only devices with this
            `process_index` are considered.

    Returns:
        A `LoadPlan`.
    """
    grid = np.asarray(mesh.devices)
    axis_sizes = dict(zip(tuple(mesh.axis_names), grid.shape))
    mesh_order = {d.id: i for i, d in enumerate(grid.flat)}
    variables = []
    for request in requests:
        dataset = request.dataset
        shape = dataset.shape
        itemsize = dataset.dtype.itemsize
        grouped: dict[Index, list[int]] = {}
        for device, index in block_indices(shape, request.spec, mesh).items():
            if device.process_index != process_index:
                continue
            grouped.setdefault(index, []).append(device.id)
        blocks = []
        for index, ids in grouped.items():
            ids.sort(key=mesh_order.__getitem__)
            runs = byte_runs(shape, itemsize, index, dataset.offset) if dataset.contiguous else None
            blocks.append(Block(index, tuple(ids), runs))
        blocks.sort(key=lambda b: (b.index, mesh_order[b.device_ids[0]]))
        strategy, read_bytes = _choose_strategy(dataset, blocks)
        spec = tuple(request.spec) + (None,) * (len(shape) - len(tuple(request.spec)))
        variables.append(
            VariablePlan(
                path=request.path,
                shape=shape,
                source_dtype=dataset.dtype,
                target_dtype=np.dtype(request.target_dtype),
                spec=spec,
                dataset=dataset,
                blocks=tuple(blocks),
                strategy=strategy,
                read_bytes=read_bytes if blocks else 0,
            )
        )
    return LoadPlan(tuple(variables), process_index, axis_sizes)
