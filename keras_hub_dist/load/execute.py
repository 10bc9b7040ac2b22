"""Executes a `LoadPlan`: read each block, cast, place, assemble.

The thin second phase of loading. For every variable of the plan:

1. each distinct local block is read into a fresh, 64-byte-aligned host
   buffer that nothing else references: `os.preadv` of its exact byte runs
   when the checkpoint stores the variable as it is (or scatter reads of the
   file's contiguous stretches into several blocks' buffers at once, see
   `block_plan`), else the checkpoint format's own `TensorSource.read` (per
   block, or once for the box the local blocks tile); then cast to the
   variable's dtype on the host, block by block;
2. the buffer goes to the first device that holds the block
   (`jax.device_put`; on CPU this may alias the buffer, which is safe because
   the loader drops it at once) and is copied device-to-device to the other
   local devices holding the same block, so a replicated variable is read once
   per process, never once per device;
3. the per-device arrays are assembled with
   `jax.make_array_from_single_device_arrays` into the variable's final
   sharding (for a planned device transpose, into its input's sharding, then
   one SPMD transpose program gives the final array) and handed to
   `on_variable`.

No full tensor is ever put on one device (unless the variable is replicated),
no file is memory-mapped, and nothing returned depends on the file: the
checkpoint can be deleted or overwritten as soon as this returns.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.base import Index
from keras_hub_dist.formats import host_io
from keras_hub_dist.formats.host_io import aligned_empty, read_runs
from keras_hub_dist.load.block_plan import Block, LoadPlan, VariablePlan

__all__ = ["ExecuteStats", "execute_plan"]

# On accelerators device_put is asynchronous; the host buffers of transfers
# in flight stay alive until they finish. Wait once this many bytes are
# pending, so host memory stays bounded by it.
_MAX_PENDING_BYTES = 1 << 30


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


def _cast(host: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if host.dtype == dtype:
        return host
    out = aligned_empty(host.shape, dtype)
    out[...] = host
    return out


def _cut(whole: np.ndarray, box: Index, index: Index, dtype: np.dtype) -> np.ndarray:
    """Block `index` of `whole` (which holds `box`), fresh, in `dtype`."""
    part = whole[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(index, box))]
    if whole.dtype != dtype:
        return _cast(np.ascontiguousarray(part), dtype)
    out = aligned_empty(part.shape, dtype)
    out[...] = part
    return out


def _read_direct(fds: host_io.FileDescriptors, var: VariablePlan, block: Block, stats: ExecuteStats) -> np.ndarray:
    host = aligned_empty(block.read_shape, var.source_dtype)
    read_runs(fds(var.read_source.stored.file), block.runs, host, stats.add_read)
    return _cast(host, var.target_dtype)


def _read_source(fds: host_io.FileDescriptors, var: VariablePlan, block: Block, stats: ExecuteStats) -> np.ndarray:
    source, index = var.read_source, block.read_index or block.index
    host = source.read(index)
    if host.shape != block.read_shape or host.dtype != var.source_dtype:
        raise PresetError(
            f"The checkpoint reader returned a block of shape {host.shape}, "
            f"{host.dtype}. Expected {block.read_shape}, {var.source_dtype} for "
            f"block {index} of {source.description}."
        )
    stats.add_read(source.read_nbytes(index), 1)
    return _cast(host, var.target_dtype)


@functools.lru_cache(maxsize=None)
def _transposer(perm: tuple[int, ...], sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    """One SPMD program for all devices: each transposes its own block."""
    return jax.jit(functools.partial(jnp.transpose, axes=perm), out_shardings=sharding)


def _input_sharding(sharding: jax.sharding.Sharding, perm: tuple[int, ...]) -> jax.sharding.Sharding:
    """The sharding of a transpose's input whose output has `sharding`."""
    spec = tuple(sharding.spec) + (None,) * (len(perm) - len(tuple(sharding.spec)))
    moved = [None] * len(perm)
    for i, p in enumerate(perm):
        moved[p] = spec[i]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*moved))


def _read_scatter(fds: host_io.FileDescriptors, var: VariablePlan, stats: ExecuteStats) -> Iterator[tuple[Block, np.ndarray]]:
    """Reads each contiguous stretch of the file with one `preadv` whose iovecs
    point into the blocks' buffers; yields blocks as they complete."""
    fd = fds(var.read_source.stored.file)
    offsets, lengths, owners, targets = host_io.sorted_pieces([b.runs for b in var.blocks])
    left = [0] * len(var.blocks)
    for b in owners:
        left[b] += 1
    hosts: dict[int, np.ndarray] = {}
    views: dict[int, memoryview] = {}
    for i, j in host_io.contiguous_groups(offsets, lengths):
        iovecs: list[memoryview] = []
        for k in range(i, j):
            b = owners[k]
            if b not in views:
                hosts[b] = aligned_empty(var.blocks[b].read_shape, var.source_dtype)
                views[b] = memoryview(hosts[b].reshape(-1).view(np.uint8))
            iovecs.append(views[b][targets[k] : targets[k] + lengths[k]])
        size = sum(lengths[i:j])
        stats.add_read(size, host_io.preadv_full(fd, iovecs, offsets[i]))
        del iovecs
        for k in range(i, j):
            b = owners[k]
            left[b] -= 1
            if not left[b]:
                del views[b]
                yield var.blocks[b], _cast(hosts.pop(b), var.target_dtype)
    for block in var.blocks:  # Blocks of zero bytes.
        if not block.runs.num_runs:
            yield block, aligned_empty(block.read_shape, var.target_dtype)


def _host_blocks(
    fds: host_io.FileDescriptors,
    var: VariablePlan,
    stats: ExecuteStats,
    pool: ThreadPoolExecutor | None,
    num_threads: int,
) -> Iterator[tuple[Block, np.ndarray]]:
    if var.strategy == "scatter":
        yield from _read_scatter(fds, var, stats)
        return
    if var.strategy == "read_union":
        whole = var.read_source.read(var.union)
        stats.add_read(var.read_source.read_nbytes(var.union), 1)
        for block in var.blocks:
            yield block, _cut(whole, var.union, block.read_index or block.index, var.target_dtype)
        return
    read = _read_direct if var.strategy == "direct" else _read_source
    if pool is None or len(var.blocks) < 2:
        for block in var.blocks:
            yield block, read(fds, var, block, stats)
        return
    if var.read_source.stored is not None:
        fds(var.read_source.stored.file)  # opened here, not racing in the threads
    # A few blocks in flight: reads overlap (the GIL is released in preadv and
    # page faults), while host memory stays bounded by the window.
    window: collections.deque = collections.deque()
    blocks = iter(var.blocks)
    for block in blocks:
        window.append((block, pool.submit(read, fds, var, block, stats)))
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
    progress: Any = None,
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
        progress: A progress bar (`tqdm`) advanced by the bytes read and
            closed at the end.
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
    fds = host_io.FileDescriptors()
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
                for block, host in _host_blocks(fds, var, stats, pool, num_threads):
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
                if var.device_perm is None:
                    array = jax.make_array_from_single_device_arrays(
                        var.shape, shardings[var.path], per_device
                    )
                else:
                    perm = var.device_perm
                    untransposed = jax.make_array_from_single_device_arrays(
                        var.read_source.shape, _input_sharding(shardings[var.path], perm), per_device
                    )
                    del per_device[:]
                    array = _transposer(perm, shardings[var.path])(untransposed)
                    untransposed.delete()
                created.append(array)
                del per_device
                on_variable(var, array)
            except PresetError as e:
                raise PresetError(f"Loading variable {var.path!r} failed: {e}") from e
            except Exception as e:  # noqa: BLE001 - re-raised with the path
                raise PresetError(
                    f"Loading variable {var.path!r} (shape {var.shape}, "
                    f"{var.source_dtype} -> {var.target_dtype}, spec "
                    f"{var.spec}) from {var.source.description} failed: "
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
        fds.close()
        if progress is not None:
            progress.close()
    return stats
