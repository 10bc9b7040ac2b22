"""Executes a `LoadPlan`: read each block, cast, place, assemble.

The thin second phase of loading. For every variable of the plan:

1. each distinct local block is read into a 64-byte-aligned host buffer
   that nothing else references (fresh, or one whose values were consumed:
   the input of a transpose that has run, see `host_io.BufferPool`): its
   exact byte runs when the
   checkpoint stores the variable as it is (`preadv` per block, or the
   file's contiguous stretches read into several blocks' buffers at once;
   a remote file always the latter, one range request per stretch, see
   `block_plan` and `storage.ranged_http`), else the checkpoint format's own
   `TensorSource.read` (per block, or once for the box the local blocks
   tile); then cast to the variable's dtype on the host, block by block;
2. the buffer goes to the first device that holds the block
   (`jax.device_put`; on CPU this may alias the buffer, which is safe because
   the loader drops it at once) and is copied device-to-device to the other
   local devices holding the same block, so a replicated variable is read once
   per process, never once per device;
3. the per-device arrays are assembled with
   `jax.make_array_from_single_device_arrays` into the variable's final
   sharding (for a planned device transpose, into its input's sharding, then
   one SPMD transpose program gives the final array) and handed to
   `on_variable`. A variable planned as an `Exchange` (blocks that devices of
   several processes hold) is instead born as zeros in its sharding and
   filled round by round: each round's parts, read by the processes that
   hold them, are gathered across the processes' devices and written in
   place by one SPMD program (the array is donated), so no device holds
   more than the variable plus one round's pieces. On CPU each round's
   program is waited for before anything else is dispatched (XLA's CPU
   client could otherwise deadlock the job, see `_await_collective`).

Reading runs ahead: worker threads read whole variables, in plan order, while
the caller places earlier ones (at most `PREFETCH_BYTES` read ahead), so
reading, host transforms and device work overlap; a remote load reads up to
`concurrency` variables at once. A failure stops the read-ahead (no variable
starts after it), waits for the reads in flight, and deletes every array
created.

No full tensor is ever put on one device (unless the variable is replicated),
no file is memory-mapped, and nothing returned depends on the file: the
checkpoint can be deleted or overwritten as soon as this returns.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_hub_dist import _processes
from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.base import Index
from keras_hub_dist.storage import host_io
from keras_hub_dist.storage.host_io import aligned_empty
from keras_hub_dist.load.block_plan import Block, LoadPlan, Round, VariablePlan
from keras_hub_dist.load.read_ahead import Prefetch, RoundsAhead

__all__ = ["ExecuteStats", "execute_plan"]

# On accelerators device_put is asynchronous; the host buffers of transfers
# in flight stay alive until they finish. Wait once this many bytes are
# pending, so host memory stays bounded by it.
_MAX_PENDING_BYTES = 1 << 30
# Host bytes read ahead of the variable being placed (see `read_ahead.Prefetch`).
PREFETCH_BYTES = 1 << 30
# A scattered variable's stretches are read this many bytes at a time (all
# of a window's requests in flight together for a remote file).
_SCATTER_WINDOW_BYTES = 256 << 20
# Exchange rounds read ahead of the round being placed.
_ROUNDS_AHEAD = 2
# Transposed variables left to finish before their input buffers are taken
# back (waiting on the oldest then rarely waits).
_RETIRING = 2


@dataclass
class ExecuteStats:
    """What the executor did: bytes and read calls, per process."""

    bytes_read: int = 0
    read_calls: int = 0
    blocks: int = 0
    device_copies: int = 0
    host_bytes_reused: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_read(self, nbytes: int, calls: int) -> None:
        with self._lock:  # reader threads report concurrently
            self.bytes_read += nbytes
            self.read_calls += calls


def _cast(host: np.ndarray, dtype: np.dtype, buffers: host_io.BufferPool) -> np.ndarray:
    if host.dtype == dtype:
        return host
    out = buffers.empty(host.shape, dtype)
    out[...] = host
    buffers.give(host)
    return out


def _cut(whole: np.ndarray, box: Index, index: Index, dtype: np.dtype, buffers: host_io.BufferPool) -> np.ndarray:
    """Block `index` of `whole` (which holds `box`), fresh, in `dtype`."""
    part = whole[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(index, box))]
    if whole.dtype != dtype:
        return _cast(np.ascontiguousarray(part), dtype, buffers)
    out = buffers.empty(part.shape, dtype)
    out[...] = part
    return out


def _file(readers: host_io.Readers, var: VariablePlan) -> Any:
    stored = var.read_source.stored
    return readers(stored.file, stored.opened)


def _is_remote(readers: host_io.Readers, var: VariablePlan) -> bool:
    return not isinstance(_file(readers, var), host_io.LocalFile)


def _read_direct(
    readers: host_io.Readers, var: VariablePlan, block: Block, stats: ExecuteStats, buffers: host_io.BufferPool
) -> np.ndarray:
    host = buffers.empty(block.read_shape, var.source_dtype)
    _file(readers, var).read_stretches(host_io.run_stretches(block.runs, host), stats.add_read)
    return _cast(host, var.target_dtype, buffers)


def _read_source(
    readers: host_io.Readers, var: VariablePlan, block: Block, stats: ExecuteStats, buffers: host_io.BufferPool
) -> np.ndarray:
    source, index = var.read_source, block.read_index or block.index
    host = source.read(index)
    if host.shape != block.read_shape or host.dtype != var.source_dtype:
        raise PresetError(
            f"The checkpoint reader returned a block of shape {host.shape}, "
            f"{host.dtype}. Expected {block.read_shape}, {var.source_dtype} for "
            f"block {index} of {source.description}."
        )
    stats.add_read(source.read_nbytes(index), 1)
    return _cast(host, var.target_dtype, buffers)


@functools.lru_cache(maxsize=None)
def _transposer(perm: tuple[int, ...], sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    """One SPMD program for all devices: each transposes its own block."""
    return jax.jit(functools.partial(jnp.transpose, axes=perm), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zero array born in `sharding` (each device allocates its block)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _exchanger(
    shape: tuple[int, ...], dim: int, parts: int, piece: int, sharding: jax.sharding.Sharding
) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """One SPMD program per round of an `Exchange`: the round's pieces,
    gathered across the processes' devices, written in place (the array is
    donated) at `offset` inside every part of dimension `dim`."""
    view = shape[:dim] + (parts, shape[dim] // parts) + shape[dim + 1 :]
    view_spec = tuple(sharding.spec) + (None,) * (len(shape) - len(tuple(sharding.spec)))
    view_spec = view_spec[:dim] + (view_spec[dim], None) + view_spec[dim + 1 :]
    view_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*view_spec))

    def update(array: jax.Array, pieces: jax.Array, offset: jax.Array) -> jax.Array:
        whole = jax.lax.with_sharding_constraint(array.reshape(view), view_sharding)
        gathered = jax.lax.with_sharding_constraint(
            pieces.reshape(view[:dim] + (parts, piece) + view[dim + 2 :]), view_sharding
        )
        start = [0] * len(view)
        start[dim + 1] = offset
        return jax.lax.dynamic_update_slice(whole, gathered, start).reshape(shape)

    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


def _input_sharding(sharding: jax.sharding.Sharding, perm: tuple[int, ...]) -> jax.sharding.Sharding:
    """The sharding of a transpose's input whose output has `sharding`."""
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(tuple(sharding.spec)))
    moved = [None] * len(perm)
    for i, p in enumerate(perm):
        moved[p] = spec[i]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*moved))


def _read_scatter(
    readers: host_io.Readers, var: VariablePlan, stats: ExecuteStats, buffers: host_io.BufferPool
) -> Iterator[tuple[Block, np.ndarray]]:
    """Reads each contiguous stretch of the file into the blocks' buffers
    (iovecs pointing into them: one `preadv`, or one range request, per
    stretch), a window of stretches at a time; yields blocks as they
    complete."""
    file = _file(readers, var)
    offsets, lengths, owners, targets = host_io.sorted_pieces([b.runs for b in var.blocks])
    left = [0] * len(var.blocks)
    for b in owners:
        left[b] += 1
    hosts: dict[int, np.ndarray] = {}
    views: dict[int, memoryview] = {}
    window: list[tuple[int, list[memoryview]]] = []
    window_pieces: list[int] = []
    window_bytes = 0
    groups = list(host_io.contiguous_groups(offsets, lengths, *file.stretch_limits))
    for number, (i, j) in enumerate(groups):
        iovecs: list[memoryview] = []
        for k in range(i, j):
            b = owners[k]
            if b not in views:
                hosts[b] = buffers.empty(var.blocks[b].read_shape, var.source_dtype)
                views[b] = memoryview(hosts[b].reshape(-1).view(np.uint8))
            iovecs.append(views[b][targets[k] : targets[k] + lengths[k]])
        window.append((offsets[i], iovecs))
        window_pieces.extend(range(i, j))
        window_bytes += sum(lengths[i:j])
        if window_bytes < _SCATTER_WINDOW_BYTES and number + 1 < len(groups):
            continue
        file.read_stretches(window, stats.add_read)
        window, window_bytes = [], 0
        for k in window_pieces:
            b = owners[k]
            left[b] -= 1
            if not left[b]:
                del views[b]
                yield var.blocks[b], _cast(hosts.pop(b), var.target_dtype, buffers)
        window_pieces = []
    for block in var.blocks:  # Blocks of zero bytes.
        if not block.runs.num_runs:
            yield block, aligned_empty(block.read_shape, var.target_dtype)


def _host_blocks(
    readers: host_io.Readers,
    var: VariablePlan,
    stats: ExecuteStats,
    pool: ThreadPoolExecutor | None,
    num_threads: int,
    buffers: host_io.BufferPool,
) -> Iterator[tuple[Block, np.ndarray]]:
    if var.strategy == "scatter" or (var.strategy == "direct" and _is_remote(readers, var)):
        # Remote blocks are fetched as the file's contiguous stretches (one
        # range request each, cut into chunks that run concurrently), not a
        # request per block.
        yield from _read_scatter(readers, var, stats, buffers)
        return
    if var.strategy == "read_union":
        whole = var.read_source.read(var.union)
        stats.add_read(var.read_source.read_nbytes(var.union), 1)
        for block in var.blocks:
            yield block, _cut(whole, var.union, block.read_index or block.index, var.target_dtype, buffers)
        return
    read = _read_direct if var.strategy == "direct" else _read_source
    if pool is None or len(var.blocks) < 2:
        for block in var.blocks:
            yield block, read(readers, var, block, stats, buffers)
        return
    if var.read_source.stored is not None:
        _file(readers, var)  # opened here, not racing in the threads
    # A few blocks in flight: reads overlap (the GIL is released in preadv,
    # page faults and network reads), while host memory stays bounded by the
    # window.
    window: collections.deque = collections.deque()
    for block in var.blocks:
        window.append((block, pool.submit(read, readers, var, block, stats, buffers)))
        if len(window) > num_threads:
            done_block, future = window.popleft()
            yield done_block, future.result()
    while window:
        done_block, future = window.popleft()
        yield done_block, future.result()


class _Placer:
    """Puts host blocks on their devices: the first holder by `device_put`,
    the others by a device-to-device copy (a replicated block is read once
    per process)."""

    def __init__(self, devices: Mapping[int, Any], stats: ExecuteStats) -> None:
        self.devices = devices
        self.stats = stats
        self.on_cpu = all(d.platform == "cpu" for d in devices.values())
        self.pending: list[jax.Array] = []
        self.pending_bytes = 0

    def place_all(self, host_blocks: list[tuple[Block, np.ndarray]]) -> list[jax.Array]:
        """Every block on every device that holds it, in block order; the
        host buffers are dropped as they go."""
        per_device: list[jax.Array] = []
        while host_blocks:
            block, host = host_blocks.pop(0)
            first = jax.device_put(host, self.devices[block.device_ids[0]])
            per_device.append(first)
            for device_id in block.device_ids[1:]:
                per_device.append(jax.device_put(first, self.devices[device_id]))
                self.stats.device_copies += 1
            self.stats.blocks += 1
            if not self.on_cpu:
                self.pending.append(first)
                self.pending_bytes += host.nbytes
                if self.pending_bytes >= _MAX_PENDING_BYTES:
                    jax.block_until_ready(self.pending)
                    self.pending, self.pending_bytes = [], 0
            del host
        return per_device


def _round_view(var: VariablePlan, round_: Round) -> VariablePlan:
    """The variable as one exchange round reads it."""
    return dataclasses.replace(
        var, blocks=round_.blocks, strategy=round_.strategy, union=round_.union, exchange=None
    )


def _exchange(
    var: VariablePlan,
    rounds: Iterable[tuple[Round, list[tuple[Block, np.ndarray]]]],
    sharding: jax.sharding.Sharding,
    placer: _Placer,
    created: list[jax.Array],
) -> jax.Array:
    """The variable's array (in its read source's coordinates, `sharding`)
    from the pieces this process read, gathered round by round in place."""
    exchange = var.exchange
    shape = tuple(var.read_source.shape)
    array = _zeros(shape, var.target_dtype, sharding)()
    created.append(array)  # deleted if a round fails
    pieces_sharding = jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*exchange.spec)
    )
    piece = shape[exchange.dim] // exchange.parts // len(exchange.rounds)
    update = _exchanger(shape, exchange.dim, exchange.parts, piece, sharding)
    for round_, host_blocks in rounds:
        _processes.reached("exchange")
        pieces = jax.make_array_from_single_device_arrays(
            round_.shape, pieces_sharding, placer.place_all(host_blocks)
        )
        created[-1] = array = update(array, pieces, round_.offset)
        pieces.delete()
        if placer.on_cpu:
            _await_collective(array)
    created.pop()
    return array


def _await_collective(array: jax.Array) -> None:
    """Waits for the cross-process program that computes `array`.

    XLA's CPU client runs both the launch of a program on each local device
    and each device's share of a running program on one thread pool of
    `max(cores, local devices)` threads, and a launch waits on that pool
    thread while its device has 32 programs in flight. Dispatching the
    rounds' programs without waiting (each returns at once) lets the
    in-flight programs reach 32 when the exchanged variables are many and
    small (a LoRA adapter's factors: 2 programs per variable, no host work
    between them); the next launch then holds a pool thread, the oldest
    cross-process program cannot run on all its devices, its gather waits
    forever for the missing ones, and the job deadlocks (4 CPU devices per
    process on 2 cores: 4 threads). Waiting here keeps at most one
    cross-process program in flight, and no launch on the pool while it
    runs, so every device's share of it finds a thread. The other
    processes wait for the same program: plan order is the same everywhere.
    GPU and TPU clients run a program's shares on streams, not on the
    launching pool, so there the rounds keep overlapping with placement.
    A lost process ends the wait (`_processes.await_ready`).
    """
    _processes.await_ready(array)


def _buffer_sizes(plan: LoadPlan) -> Iterator[int]:
    """The byte size of every host buffer the reads of `plan` ask for."""
    for var in plan.variables:
        views = [var] if var.exchange is None else [_round_view(var, r) for r in var.exchange.rounds]
        for view in views:
            for block in view.blocks:
                elements = math.prod(block.read_shape)
                yield elements * var.source_dtype.itemsize
                if var.source_dtype != var.target_dtype:
                    yield elements * var.target_dtype.itemsize


def _retire(retiring: collections.deque, buffers: host_io.BufferPool, keep: int) -> None:
    """Gives back the input buffers of all but the last `keep` transposes,
    each once its output is computed (then nothing reads its input)."""
    while len(retiring) > keep:
        array, inputs = retiring.popleft()
        if array.is_deleted():  # no way to wait for it: leave its inputs be
            continue
        array.block_until_ready()
        for host in inputs:
            buffers.give(host)


def execute_plan(
    plan: LoadPlan,
    shardings: Mapping[str, jax.sharding.Sharding],
    devices: Mapping[int, Any],
    on_variable: Callable[[VariablePlan, jax.Array], None],
    *,
    progress: Any = None,
    num_threads: int = 2,
    prefetch_threads: int | None = None,
    prefetch_bytes: int = PREFETCH_BYTES,
    on_failure: Callable[[], None] | None = None,
) -> ExecuteStats:
    """Reads and places every variable of `plan`, calling `on_variable` per one.

    Args:
        plan: The plan of this process.
        shardings: Variable path -> the `jax.sharding.Sharding` of its final
            array (its addressable devices must be the plan's devices).
        devices: Device id -> `jax.Device`.
        on_variable: Receives each variable's plan and global `jax.Array` as
            soon as it is complete (e.g. to fill the Keras variable).
        progress: A progress bar (`tqdm`) advanced by the bytes read and
            closed at the end.
        num_threads: Blocks of a variable read concurrently (`"direct"`
            strategy); 1 reads each variable's blocks one after another.
        prefetch_threads: Variables read ahead concurrently while earlier
            ones are placed (default `num_threads`; remote checkpoints use
            more, as their reads wait on the network).
        prefetch_bytes: The most host bytes read ahead of the variable being
            placed.
        on_failure: Called first when the load fails, before waiting for
            the reads in flight (e.g. to stop a remote client's retries).

    Returns:
        `ExecuteStats` of this process.

    Raises:
        PresetError: Reading or placing a variable failed; the message names
            the variable path. Every array created so far is deleted first,
            so a failed load leaves no device memory behind.
    """
    stats = ExecuteStats()
    readers = host_io.Readers()
    created: list[jax.Array] = []
    reported = 0
    placer = _Placer(devices, stats)
    buffers = host_io.BufferPool(_buffer_sizes(plan))
    # Transposed variables whose input buffers go back to `buffers` once
    # their transposes have run.
    retiring: collections.deque[tuple[jax.Array, list[np.ndarray]]] = collections.deque()
    pool = ThreadPoolExecutor(num_threads, "keras_hub_dist-read") if num_threads > 1 else None

    rounds_ahead: list[RoundsAhead] = []

    def produce(var: VariablePlan) -> Any:
        if var.exchange is None:
            return list(_host_blocks(readers, var, stats, pool, num_threads, buffers))
        rounds = RoundsAhead(
            ((r, list(_host_blocks(readers, _round_view(var, r), stats, pool, num_threads, buffers))) for r in var.exchange.rounds),
            _ROUNDS_AHEAD,
        )
        rounds_ahead.append(rounds)
        return rounds

    prefetch = Prefetch(plan.variables, produce, prefetch_threads or num_threads, prefetch_bytes)
    try:
        for var, future in prefetch:
            _processes.reached("variable")
            try:
                read_sharding = shardings[var.path]
                if var.device_perm is not None:
                    read_sharding = _input_sharding(read_sharding, var.device_perm)
                # Host buffers a transpose consumes, given back once it ran.
                inputs: list[np.ndarray] = []
                if var.exchange is None:
                    host_blocks = future.result()
                    if var.device_perm is not None:
                        inputs = [host for _, host in host_blocks]
                    per_device = placer.place_all(host_blocks)
                    array = jax.make_array_from_single_device_arrays(
                        var.read_source.shape, read_sharding, per_device
                    )
                    del per_device
                else:
                    array = _exchange(var, future.result(), read_sharding, placer, created)
                if progress is not None:
                    progress.update(stats.bytes_read - reported)
                    reported = stats.bytes_read
                if var.device_perm is not None:
                    untransposed = array
                    array = _transposer(var.device_perm, shardings[var.path])(untransposed)
                    untransposed.delete()
                    if inputs:
                        retiring.append((array, inputs))
                        _retire(retiring, buffers, keep=_RETIRING)
                created.append(array)
                on_variable(var, array)
            except Exception as e:  # noqa: BLE001 - re-raised with the path
                if _processes.lost_process_cause(e) is not None:
                    raise  # a lost process, not this variable's file: loader.py names it
                if isinstance(e, PresetError):
                    raise PresetError(f"Loading variable {var.path!r} failed: {e}") from e
                raise PresetError(
                    f"Loading variable {var.path!r} (shape {var.shape}, "
                    f"{var.source_dtype} -> {var.target_dtype}, spec "
                    f"{var.spec}) from {var.source.description} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
        jax.block_until_ready(created)
    except BaseException:
        if on_failure is not None:
            on_failure()
        prefetch.close()
        for array in created:
            try:
                array.delete()
            except Exception:  # noqa: BLE001 - already deleted
                pass
        raise
    finally:
        prefetch.close()
        retiring.clear()
        stats.host_bytes_reused = buffers.reused_bytes
        buffers.clear()
        for rounds in rounds_ahead:
            rounds.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        readers.close()
        if progress is not None:
            progress.close()
    return stats
