"""Positioned writes of one block through its pieces (`formats.pieces`).

A block of a leaf (a device's block of a variable when exporting, a tile of
a source tensor when converting) lands in the target file as strided byte
runs (`BlockWrite.runs`), its elements in the file's order
(`BlockWrite.values`, a view of the block). When that view is contiguous
and of the file's dtype it is written as it is, with no copy (on CPU straight
from the device buffer); otherwise it is copied into one reusable host
buffer of `CHUNK_BYTES`, a slab of outermost indices at a time (casting on
the way), and written from there. So the host memory a write adds is at
most `CHUNK_BYTES`, whatever the block.

The copy runs in tiles of `TILE` outermost x innermost indices: a
transposed view read element by element walks memory with a large stride,
and tiles keep both sides in cache (about 3x faster than one `copyto` on
this machine, see BENCHMARKS.md). A writer given a `transpose_device` (the
converter's, a CPU device) instead has XLA rearrange a view that is a pure
permutation of a contiguous array: slab by slab of `XLA_SLAB_BYTES` of the
array's leading axis, each slab's result copied into one reused host buffer
(contiguous runs) that is then written. A conversion transposes nearly
every kernel byte, and for one 64 MiB bfloat16 tile of a Gemma-7B kernel
(`benchmarks/bench_transpose.py`, BENCHMARKS.md) NumPy's size-2 strided
copy rearranges 0.81 GB per CPU-second, XLA on the whole tile 1.03 (its
64 MiB output is fresh memory each time) and XLA slab by slab 2.40.

Example:

```python
writer = PieceWriter(host_io.FileDescriptors(os.O_WRONLY))
writer.write(block_values, [("model-00001-of-00001.safetensors", write, np.float32)])
```
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import ByteRuns
from keras_hub_dist.formats.pieces import BlockWrite

__all__ = ["CHUNK_BYTES", "PieceWriter", "PieceWriteStats"]

# The host buffer a copied write goes through.
CHUNK_BYTES = 16 << 20
# (outermost, innermost) indices per tile of a copy.
TILE = (256, 256)
# Views from this size on are rearranged by XLA when the writer has a
# `transpose_device` (below it, a program's dispatch costs more than it saves),
# in slabs of this many bytes.
XLA_TRANSPOSE_MIN_BYTES = 1 << 20
XLA_SLAB_BYTES = 8 << 20


@dataclass
class PieceWriteStats:
    """What a writer did: bytes, `pwritev` calls, bytes that needed a copy."""

    bytes_written: int = 0
    write_calls: int = 0
    bytes_copied: int = 0


def _tiled_copy(out: np.ndarray, values: np.ndarray) -> None:
    """`out[...] = values` (casting), in cache-sized tiles."""
    if values.ndim < 2 or values.flags.c_contiguous:
        np.copyto(out, values, casting="unsafe")
        return
    rows, cols = TILE
    for i in range(0, values.shape[0], rows):
        for j in range(0, values.shape[-1], cols):
            np.copyto(out[i : i + rows, ..., j : j + cols], values[i : i + rows, ..., j : j + cols], casting="unsafe")


def permuted(values: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """`(base, perm)` with `values == base.transpose(perm)` and `base`
    C-contiguous (a view of the same memory), or None if `values` is not a
    permutation of a contiguous array (a slice of one, say)."""
    order = sorted(range(values.ndim), key=lambda d: -values.strides[d])
    base = np.lib.stride_tricks.as_strided(
        values, tuple(values.shape[d] for d in order), tuple(values.strides[d] for d in order), writeable=False
    )
    if not base.flags.c_contiguous:
        return None
    return base, tuple(int(k) for k in np.argsort(order))


@functools.lru_cache(maxsize=None)
def _transposer(perm: tuple[int, ...]) -> Callable[[jax.Array], jax.Array]:
    """Runs on the device its input was put on."""
    return jax.jit(functools.partial(jnp.transpose, axes=perm))


class PieceWriter:
    """Writes blocks through their `BlockWrite`s, reusing one host buffer.

    Args:
        files: Open target files (`os.O_WRONLY`), by path.
        chunk_bytes: Size of the host buffer copies go through.
        on_written: Told of the byte runs of each file as they are written
            (`formats.checksums.HashingAsWritten.written`).
        transpose_device: A CPU `jax.Device` on which XLA rearranges views
            that are permutations of contiguous arrays; None: NumPy copies.
    """

    def __init__(
        self,
        files: host_io.FileDescriptors,
        chunk_bytes: int = CHUNK_BYTES,
        on_written: Callable[[str, ByteRuns], None] | None = None,
        transpose_device: Any = None,
    ) -> None:
        self.files = files
        self.chunk_bytes = chunk_bytes
        self.on_written = on_written
        self.transpose_device = transpose_device
        self._arranged: np.ndarray | None = None
        self.stats = PieceWriteStats()
        self._buffer: np.ndarray | None = None

    def _chunk(self, nbytes: int) -> np.ndarray:
        if self._buffer is None:
            self._buffer = host_io.aligned_empty((self.chunk_bytes,), np.uint8)
        return self._buffer[:nbytes]

    def write(self, block: np.ndarray, writes: Sequence[tuple[str, BlockWrite, np.dtype]]) -> None:
        """Writes `block`'s part of each `(file path, write, file dtype)`."""
        for path, write, dtype in writes:
            fd = self.files(path)
            values = write.values(block)
            if values.dtype == dtype and values.flags.c_contiguous:
                self._put(fd, path, write.runs(), values, copied=False)
                continue
            if self._write_transposed(fd, path, write, values, dtype):
                continue
            if values.ndim == 0:
                values = values.reshape(1)
            row = math.prod(values.shape[1:]) * np.dtype(dtype).itemsize
            step = max(1, self.chunk_bytes // max(row, 1))
            for first in range(0, values.shape[0], step):
                stop = min(values.shape[0], first + step)
                part = values[first:stop]
                if row * (stop - first) > self.chunk_bytes:  # one row over the buffer
                    out = host_io.aligned_empty(part.shape, dtype)
                else:
                    out = self._chunk(row * (stop - first)).view(dtype).reshape(part.shape)
                _tiled_copy(out, part)
                self._put(fd, path, write.runs(first, stop) if write.shape else write.runs(), out, copied=True)

    def _put(self, fd: int, path: str, runs: ByteRuns, values: np.ndarray, copied: bool) -> None:
        """Writes contiguous `values` at `runs` of `path`, counted and told."""
        self.stats.write_calls += host_io.write_runs(self.files, fd, runs, values)
        self.stats.bytes_written += values.nbytes
        if copied:
            self.stats.bytes_copied += values.nbytes
        if self.on_written is not None:
            self.on_written(path, runs)

    def _write_transposed(self, fd: int, path: str, write: BlockWrite, values: np.ndarray, dtype: np.dtype) -> bool:
        """Writes `values` rearranged by XLA, if this writer can; whether it did."""
        if self.transpose_device is None or values.dtype != dtype or values.nbytes < XLA_TRANSPOSE_MIN_BYTES:
            return False
        arranged = permuted(values)
        if arranged is None:
            return False
        base, perm = arranged
        if self._arranged is None or self._arranged.nbytes < values.nbytes:
            self._arranged = host_io.aligned_empty((values.nbytes,), np.uint8)
        out = self._arranged[: values.nbytes].view(dtype).reshape(values.shape)
        axis = perm.index(0)  # where the base's leading axis lands
        step = max(1, XLA_SLAB_BYTES // max(base[:1].nbytes, 1))
        transpose = _transposer(perm)
        for first in range(0, base.shape[0], step):
            slab = transpose(jax.device_put(base[first : first + step], self.transpose_device))
            index = [slice(None)] * values.ndim
            index[axis] = slice(first, first + step)
            np.copyto(out[tuple(index)], np.asarray(slab))  # runs of the slab's rows
            slab.delete()
        self._put(fd, path, write.runs(), out, copied=True)
        return True
