"""The block plan: which block of which variable goes to which device.

Pure functions over shapes, partition specs, a device grid and where each
variable's values are (`formats.base.TensorSource`): nothing here reads a
weight or touches a device, so a plan can be built and checked with a fake
mesh (`tests/fakes.py`) in a test, and every process of a multi-host job
plans only what its own devices hold.

For each variable the plan groups this process's devices by the block of the
global array they hold (a fully replicated variable is one block held by all
local devices): each block is read from disk once per process and copied to
the other devices that hold it. Each block's bytes in the file are an exact
set of strided runs (`formats.base.ByteRuns`) when the checkpoint stores the
variable as it is; a process reads exactly the runs of its own blocks, each
byte once. The executor reads them in one of three ways:

- `"direct"`: each block's runs straight into its buffer (one `os.preadv`
  per run); used when runs are long (or there is one per block), and blocks
  can be read in parallel.
- `"scatter"`: the runs of all local blocks merged in file order, so each
  contiguous stretch of the file is read by one `os.preadv` whose iovecs
  point into the blocks' buffers (no scratch buffer, no copy); used when runs
  are short, e.g. a kernel split along its last axis (a run per row).
- `"read"`: the checkpoint format's `TensorSource.read` per block, for
  values that are not one stored tensor as it is (a chunked HDF5 dataset, a
  tensor that must be transposed or stacked).
- `"read_union"`: `TensorSource.read`, once for the union of the local blocks when they
  tile a box exactly (e.g. all 8 devices of one host split a transposed
  kernel): the transform runs once on this process's share, with one read
  instead of a strided run per row and device, and the blocks are cut from
  it. Only up to `UNION_MAX_BYTES`, which bounds the extra host memory.

A variable whose values are a transpose of large blocks (Hugging Face
kernels are stored `(out, in)`, Keras's `(in, out)`) is planned as its
input: blocks are read as the input's byte runs, with the strategies above,
and transposed on their devices (`device_perm`) by one SPMD program; XLA
transposes several times faster than NumPy's strided copy, and a device
holds its block twice only during that program.

Example:

```python
mesh = FakeMesh({"batch": 2, "model": 4})
plan = plan_load([VariableRequest("emb", source, ("model", None), np.float32)], mesh)
plan.variables[0].blocks[0].device_ids   # (0, 4): both batch rows hold rows 0:N/4
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist.formats import transforms
from keras_hub_dist.formats.base import ByteRuns, Index, TensorSource
from keras_hub_dist.plan import specs

__all__ = [
    "Block",
    "Exchange",
    "LoadPlan",
    "Round",
    "VariablePlan",
    "VariableRequest",
    "block_indices",
    "cross_process_axes",
    "plan_load",
]

AxisEntry = str | tuple[str, ...] | None

# Runs at least this long are read one `preadv` each (blocks in parallel);
# shorter runs are merged across blocks into few large scatter reads.
DIRECT_MIN_RUN_BYTES = 256 * 1024
# The largest union of blocks `"read_union"` holds on the host at once.
UNION_MAX_BYTES = 512 * 1024 * 1024
# A block exchanged between processes (see `Exchange`) is moved this many
# bytes per device at a time, in at most `EXCHANGE_MAX_ROUNDS` rounds.
EXCHANGE_ROUND_BYTES = 16 << 20
EXCHANGE_MAX_ROUNDS = 32
# Transposes of blocks from this size on run on the devices; smaller ones on
# the host, where the device's moment of two copies would be a visible
# fraction of a small model.
DEVICE_TRANSPOSE_MIN_BYTES = 1 << 20


def block_indices(
    shape: Sequence[int], spec: Sequence[AxisEntry], mesh: Any
) -> dict[Any, Index]:
    """Device -> `((start, stop), ...)` of the block it holds.

    Follows `jax.sharding.NamedSharding`: a dimension split over axes
    `(a, b)` is cut into `size(a) * size(b)` equal parts, `a` major.
    The spec must divide the shape (see `specs.validate_spec`).
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
            axes = specs.entry_axes(entry)
            parts = math.prod(sizes[a] for a in axes)
            k = 0
            for a in axes:
                k = k * sizes[a] + coords[names.index(a)]
            step = dim // parts
            index.append((k * step, (k + 1) * step))
        out[grid[coords]] = tuple(index)
    return out


@dataclass(frozen=True)
class Block:
    """One distinct block of a variable on this process.

    Attributes:
        index: `((start, stop), ...)` of the block in the global array.
        device_ids: The local devices holding it, in mesh order; the block is
            read once and copied to the others.
        runs: Its bytes in the file (`None` unless the source is stored as it
            is, `TensorSource.stored`).
        read_index: The block of the variable's `read_source` that is read
            for it (its transpose's input block under `device_perm`).
    """

    index: Index
    device_ids: tuple[int, ...]
    runs: ByteRuns | None
    read_index: Index | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.index)

    @property
    def read_shape(self) -> tuple[int, ...]:
        """Shape of the host buffer read for the block."""
        return tuple(stop - start for start, stop in (self.read_index or self.index))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, stop) for start, stop in self.index)


@dataclass(frozen=True)
class Round:
    """One round of an `Exchange`: what this process reads of it.

    Attributes:
        shape: Global shape of the round's array: the variable's, with the
            exchange dimension cut to one piece of every part.
        offset: Where the round's piece starts inside each part.
        blocks: This process's distinct blocks of the round's array
            (`index`), each read from the variable's block `read_index`.
        strategy: How they are read (see the module doc).
        read_bytes: Bytes this process reads for the round.
        union: The box the blocks tile (`"read_union"` only).
    """

    shape: tuple[int, ...]
    offset: int
    blocks: tuple[Block, ...]
    strategy: str
    read_bytes: int
    union: Index | None = None


@dataclass(frozen=True)
class Exchange:
    """Read once per job, then exchange on the device interconnect.

    A block held by devices of several processes (a data-parallel axis that
    spans hosts; a replicated variable) would be read once by each of them.
    Instead its `parts` along dimension `dim` are spread over the
    processes' devices (the mesh axes that span processes are added to that
    dimension's entry: `spec`), each process reads only its devices' parts,
    and one SPMD program per round gathers them into the variable's final
    sharding, updating it in place. Rounds keep the moment's extra device
    memory at one round's pieces.

    The same rounds serve a remote tensor that the processes split along a
    later dimension (KerasHub's layouts put the batch axis on a kernel's
    last dimension): each process's share is then a short run per row, a
    range request each (2,835 per process for a 2-layer test model, 272,460
    for the Gemma-7B-width probe). The process-spanning axes move to the
    first dimension instead, each process reads whole rows (a few long
    ranges), and the rounds' program moves each piece to its device.

    Attributes:
        spec: Partition spec of the parts (the read source's coordinates).
        dim: The dimension the parts split.
        parts: How many parts `dim` is cut into.
        rounds: The rounds, in order.
    """

    spec: tuple[AxisEntry, ...]
    dim: int
    parts: int
    rounds: tuple[Round, ...]


@dataclass(frozen=True)
class VariablePlan:
    """How one variable is read and placed on this process.

    Attributes:
        path: Keras variable path.
        shape: Global shape.
        source_dtype: Dtype of the source's values.
        target_dtype: Dtype of the variable (each block is cast on the host).
        spec: Partition spec (one entry per dimension).
        source: Where the values are.
        blocks: The distinct local blocks.
        strategy: `"direct"`, `"scatter"`, `"read"` or `"read_union"` (see
            the module doc).
        read_bytes: Bytes this process reads from the file for the variable
            (exactly the bytes of its blocks, each once).
        union: The box the local blocks tile (`"read_union"` only), in
            `read_source` coordinates.
        device_perm: Set when the values are `transpose(read_source, perm)`
            done on the devices (see the module doc).
        exchange: Set when blocks that devices of several processes hold
            are read once per job and exchanged (`Exchange`); `blocks` are
            then the final blocks, read in the exchange's rounds.
    """

    path: str
    shape: tuple[int, ...]
    source_dtype: np.dtype
    target_dtype: np.dtype
    spec: tuple[AxisEntry, ...]
    source: TensorSource
    blocks: tuple[Block, ...]
    strategy: str
    read_bytes: int
    union: Index | None = None
    device_perm: tuple[int, ...] | None = None
    exchange: Exchange | None = None

    @property
    def read_source(self) -> TensorSource:
        """What the host reads: the source, or its transpose's input."""
        return self.source.child if self.device_perm is not None else self.source

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
    source: TensorSource
    spec: tuple[AxisEntry, ...]
    target_dtype: Any


def _tiled_box(indices: Sequence[Index]) -> Index | None:
    """The box that distinct grid blocks cover exactly, if they do."""
    if len(indices) < 2:
        return None
    box = tuple(
        (min(i[d][0] for i in indices), max(i[d][1] for i in indices))
        for d in range(len(indices[0]))
    )
    covered = sum(math.prod(b - a for a, b in i) for i in indices)
    return box if covered == math.prod(b - a for a, b in box) else None


def _read_index(block: Block) -> Index:
    return block.read_index or block.index


def _choose_strategy(source: TensorSource, blocks: Sequence[Block]) -> tuple[str, int, Index | None]:
    if source.stored is None:
        indices = [_read_index(b) for b in blocks]
        box = _tiled_box(indices)
        box_bytes = math.prod(b - a for a, b in box) * np.dtype(source.dtype).itemsize if box else 0
        if box is not None and box_bytes <= UNION_MAX_BYTES and source.union_read_helps(indices):
            return "read_union", source.read_nbytes(box), box
        return "read", sum(source.read_nbytes(_read_index(b)) for b in blocks), None
    needed = sum(b.runs.nbytes for b in blocks)
    shortest = min((b.runs.run_bytes for b in blocks if b.runs.num_runs), default=0)
    if all(b.runs.num_runs <= 1 for b in blocks) or shortest >= DIRECT_MIN_RUN_BYTES:
        return "direct", needed, None
    return "scatter", needed, None


def _device_perm(source: TensorSource, block_shape: Sequence[int], dtype: Any) -> tuple[int, ...] | None:
    if not isinstance(source, transforms.Transpose):
        return None
    if math.prod(block_shape) * np.dtype(dtype).itemsize < DEVICE_TRANSPOSE_MIN_BYTES:
        return None
    return source.perm


def cross_process_axes(mesh: Any) -> tuple[str, ...]:
    """Mesh axes along which devices belong to different processes."""
    grid = np.asarray(mesh.devices)
    processes = np.vectorize(lambda d: d.process_index)(grid)
    return tuple(
        name for i, name in enumerate(mesh.axis_names)
        if (np.diff(processes, axis=i) != 0).any()
    )


def _without(entry: AxisEntry, axes: tuple[str, ...]) -> AxisEntry:
    kept = tuple(a for a in specs.entry_axes(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _fragmented(source: TensorSource, blocks: Sequence[Block]) -> bool:
    """Whether a remote tensor's share on this process is many short runs
    (a request each, at a round trip each), e.g. a kernel whose last axis
    the processes split."""
    stored = source.stored
    if stored is None or stored.opened is None or not blocks:
        return False
    indices = [b.read_index or b.index for b in blocks]
    box = tuple((min(i[d][0] for i in indices), max(i[d][1] for i in indices)) for d in range(len(indices[0])))
    runs = stored.block_runs(box)
    return runs.num_runs > 1 and runs.run_bytes < DIRECT_MIN_RUN_BYTES


def _rounds_for(piece_rows: int, block_bytes: int) -> int:
    """How many rounds exchange a block: enough that one round moves at most
    `EXCHANGE_ROUND_BYTES` (or 1/`EXCHANGE_MAX_ROUNDS` of it), a divisor of
    the rows of each part."""
    wanted = min(-(-block_bytes // EXCHANGE_ROUND_BYTES), EXCHANGE_MAX_ROUNDS, piece_rows)
    return next(r for r in range(max(wanted, 1), piece_rows + 1) if piece_rows % r == 0)


def _plan_exchange(
    source: TensorSource,
    spec: tuple[AxisEntry, ...],
    target_dtype: np.dtype,
    mesh: Any,
    process_index: int,
    cross: tuple[str, ...],
    mesh_order: dict[int, int],
    fragmented: bool = False,
) -> Exchange | None:
    """The `Exchange` of a variable whose blocks devices of several
    processes hold, or of a `fragmented` one (its process-spanning axes
    split a later dimension, so each process's share is a short run per
    row): `None` when neither applies or no dimension can take the parts."""
    sizes = dict(zip(tuple(mesh.axis_names), np.asarray(mesh.devices).shape))
    used = {a for entry in spec for a in specs.entry_axes(entry)}
    spreading = tuple(a for a in cross if a not in used)
    # Axes that split a later dimension across processes move to the first
    # one: each process then reads whole rows (a few long ranges instead of
    # a request per row) and the round's program moves them where they go.
    moving = () if spreading or not fragmented else tuple(
        a for a in cross if any(a in specs.entry_axes(entry) for entry in spec[1:])
    )
    if not spreading and not moving:
        return None
    if moving:
        spec = tuple(_without(entry, moving) for entry in spec)
        spreading = moving
    shape = tuple(source.shape)
    for dim in range(1 if moving else len(shape)):
        axes = specs.entry_axes(spec[dim]) + spreading
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts == 0 and shape[dim] // parts > 0:
            break
    else:
        return None
    staged = spec[:dim] + (axes if len(axes) > 1 else axes[0],) + spec[dim + 1 :]
    part_rows = shape[dim] // parts
    final_block = [b - a for a, b in next(iter(block_indices(shape, spec, mesh).values()))]
    rounds_count = _rounds_for(part_rows, math.prod(final_block) * target_dtype.itemsize)
    piece = part_rows // rounds_count
    round_shape = shape[:dim] + (shape[dim] // rounds_count,) + shape[dim + 1 :]
    rounds = []
    for r in range(rounds_count):
        grouped: dict[Index, list[int]] = {}
        for device, index in block_indices(round_shape, staged, mesh).items():
            if device.process_index == process_index:
                grouped.setdefault(index, []).append(device.id)
        blocks = []
        for index, ids in grouped.items():
            ids.sort(key=mesh_order.__getitem__)
            start = index[dim][0] // piece * part_rows + r * piece
            read_index = index[:dim] + ((start, start + piece),) + index[dim + 1 :]
            runs = source.stored.block_runs(read_index) if source.stored is not None else None
            blocks.append(Block(index, tuple(ids), runs, read_index))
        blocks.sort(key=lambda b: (b.index, mesh_order[b.device_ids[0]]))
        strategy, read_bytes, union = _choose_strategy(source, blocks) if blocks else ("direct", 0, None)
        rounds.append(Round(round_shape, r * piece, tuple(blocks), strategy, read_bytes, union))
    return Exchange(staged, dim, parts, tuple(rounds))


def plan_load(
    requests: Sequence[VariableRequest],
    mesh: Any,
    *,
    process_index: int = 0,
    exchange: bool = True,
) -> LoadPlan:
    """Plans what process `process_index` reads and where each block goes.

    Args:
        requests: One per variable, in load order. Specs must already be
            validated (every split dimension divisible).
        mesh: A `jax.sharding.Mesh` or a stand-in (anything with
            `axis_names` and a `devices` grid whose items have `id` and
            `process_index`).
        process_index: The process to plan for: only devices with this
            `process_index` are considered.
        exchange: Read blocks that devices of several processes hold once
            per job and exchange them (`Exchange`); else each process reads
            them itself.

    Returns:
        A `LoadPlan`.
    """
    grid = np.asarray(mesh.devices)
    axis_sizes = dict(zip(tuple(mesh.axis_names), grid.shape))
    mesh_order = {d.id: i for i, d in enumerate(grid.flat)}
    cross = cross_process_axes(mesh) if exchange else ()
    variables = []
    for request in requests:
        source = request.source
        shape = tuple(source.shape)
        grouped: dict[Index, list[int]] = {}
        for device, index in block_indices(shape, request.spec, mesh).items():
            if device.process_index != process_index:
                continue
            grouped.setdefault(index, []).append(device.id)
        perm = None
        if grouped:
            first = next(iter(grouped))
            perm = _device_perm(source, [b - a for a, b in first], request.target_dtype)
        read_source = source.child if perm is not None else source
        blocks = []
        for index, ids in grouped.items():
            ids.sort(key=mesh_order.__getitem__)
            read_index = source.child_index(index) if perm is not None else None
            stored = read_source.stored
            runs = stored.block_runs(read_index or index) if stored is not None else None
            blocks.append(Block(index, tuple(ids), runs, read_index))
        blocks.sort(key=lambda b: (b.index, mesh_order[b.device_ids[0]]))
        strategy, read_bytes, union = _choose_strategy(read_source, blocks)
        spec = tuple(request.spec) + (None,) * (len(shape) - len(tuple(request.spec)))
        exchanged = None
        if cross and blocks:
            read_spec = spec if perm is None else tuple(spec[perm.index(i)] for i in range(len(spec)))
            exchanged = _plan_exchange(
                read_source, read_spec, np.dtype(request.target_dtype), mesh, process_index,
                cross, mesh_order, fragmented=_fragmented(read_source, blocks),
            )
            if exchanged is not None:
                strategy = "exchange"
                read_bytes = sum(r.read_bytes for r in exchanged.rounds)
        variables.append(
            VariablePlan(
                path=request.path,
                shape=shape,
                source_dtype=np.dtype(source.dtype),
                target_dtype=np.dtype(request.target_dtype),
                spec=spec,
                source=source,
                blocks=tuple(blocks),
                strategy=strategy,
                read_bytes=read_bytes if blocks else 0,
                union=union,
                device_perm=perm,
                exchange=exchanged,
            )
        )
    return LoadPlan(tuple(variables), process_index, axis_sizes)
