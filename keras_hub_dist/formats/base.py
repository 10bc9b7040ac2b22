"""What the loader asks of a checkpoint: the reader protocol.

A checkpoint format answers one question per model variable: where are the
values of any block of it? The answer is a `TensorSource`:

- `shape` and `dtype`: the variable's shape, and the dtype of the values
  the source produces (before the loader casts them to the variable's dtype);
- `stored`: when the variable's values are exactly one tensor's bytes in a
  file, C-contiguous and uncompressed (a KerasHub `.weights.h5` dataset, a
  safetensors tensor read as-is), the `StoredTensor` saying where. The loader
  then plans the exact strided byte runs of each device's block
  (`StoredTensor.block_runs`) and reads them with as few `preadv` calls as it
  can, several blocks per call;
- `read(index)`: otherwise (a chunked dataset, a tensor that needs a
  transpose, a stack of experts), the block's values in fresh memory.

A format module (`keras_h5`, ...) matches a model's variables with its
tensors, validates everything (missing, extra, shapes, dtypes, file lengths),
and returns a `CheckpointIndex` of `IndexedVariable`s. The loader core never
names a file format.

Example:

```python
index = keras_h5.build_index(backbone, "preset/model.weights.h5")
entry = index.entries[0]
entry.source.stored.offset            # where its bytes start
entry.source.read(((0, 4), (0, 8)))   # or any block of it, as an array
```
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import keras
import ml_dtypes
import numpy as np

from keras_hub_dist.formats import host_io

__all__ = [
    "ByteRuns",
    "CheckpointIndex",
    "Index",
    "IndexedVariable",
    "StoredTensor",
    "StoredTensorSource",
    "TensorSource",
    "byte_runs",
    "compatible_dtypes",
    "is_float",
    "listing",
    "numpy_dtype",
]

# `((start, stop), ...)`: one half-open range per dimension of a variable.
Index = tuple[tuple[int, int], ...]


# At most this many problems are spelled out in one error message.
_MAX_LISTED = 12


def listing(items: Sequence[str]) -> str:
    """Items of an error message, one per indented line, the first 12 only."""
    shown = list(items[:_MAX_LISTED])
    more = len(items) - len(shown)
    return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")


def numpy_dtype(dtype: Any) -> np.dtype:
    """The NumPy dtype of a Keras / JAX dtype name (bfloat16 via ml_dtypes)."""
    name = keras.backend.standardize_dtype(dtype)
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def is_float(dtype: np.dtype) -> bool:
    """Whether `dtype` is a floating-point dtype (bfloat16 and float8 too)."""
    return bool(jnp.issubdtype(dtype, jnp.floating))


def compatible_dtypes(on_disk: np.dtype, expected: np.dtype) -> bool:
    """Whether a tensor of `on_disk` dtype can fill a variable of `expected`.

    Float to float is a cast (like KerasHub loading a bfloat16 preset into a
    float32 model); every other kind (ints of quantized weights, bools) must
    match exactly, since a cast would silently change meaning.
    """
    on_disk, expected = np.dtype(on_disk), np.dtype(expected)
    if on_disk.newbyteorder("=") == expected.newbyteorder("="):
        return True
    return is_float(on_disk) and is_float(expected)


@dataclass(frozen=True)
class ByteRuns:
    """The bytes of one block inside a file: `prod(counts)` runs, C order.

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
class StoredTensor:
    """A tensor stored uncompressed and C-contiguous at a byte offset of a file.

    Attributes:
        file: Path of the file.
        offset: Byte offset of element 0.
        shape: Shape of the stored tensor.
        dtype: Its dtype.
    """

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def block_runs(self, index: Index) -> ByteRuns:
        """The file byte runs of block `index`, in the block's C order."""
        return byte_runs(self.shape, self.dtype.itemsize, index, self.offset)

    def read(self, index: Index) -> np.ndarray:
        """Block `index` in fresh, aligned memory (one `preadv` per run)."""
        out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        fd = os.open(self.file, os.O_RDONLY)
        try:
            host_io.read_runs(fd, self.block_runs(index), out)
        finally:
            os.close(fd)
        return out


class TensorSource(abc.ABC):
    """The values of one model variable in a checkpoint, block by block.

    Attributes:
        shape: The variable's shape.
        dtype: The dtype of the values `read` returns.
        stored: Set when the values are exactly a stored tensor's bytes (the
            loader then reads byte runs itself); `None` otherwise.
        description: Where the values come from, for messages (a file and a
            dataset or tensor name).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    stored: StoredTensor | None = None
    description: str = ""

    @abc.abstractmethod
    def read(self, index: Index) -> np.ndarray:
        """Returns block `index` of the variable, in fresh memory that
        nothing else references, with dtype `self.dtype`."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole variable, in `dtype`."""
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def read_nbytes(self, index: Index) -> int:
        """Bytes read from files to produce block `index`."""
        return math.prod(b - a for a, b in index) * self.dtype.itemsize


class StoredTensorSource(TensorSource):
    """A variable whose values are one stored tensor, as it is."""

    def __init__(self, stored: StoredTensor, description: str = "") -> None:
        self.stored = stored
        self.shape = stored.shape
        self.dtype = stored.dtype
        self.description = description or f"{stored.file!r} at byte {stored.offset}"

    def read(self, index: Index) -> np.ndarray:
        return self.stored.read(index)

    def read_nbytes(self, index: Index) -> int:
        return self.stored.block_runs(index).nbytes


@dataclass(frozen=True)
class IndexedVariable:
    """A model variable matched with the source of its values."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    source: TensorSource
    variable: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class CheckpointIndex:
    """Every variable of a model with the source it loads from, in model order.

    Attributes:
        files: The checkpoint's weight files.
        entries: One per model variable, in `model.weights` order.
        total_bytes: Bytes of all the checkpoint's tensors on disk.
        format: A short name of the format (`"keras_h5"`, ...).
    """

    files: tuple[str, ...]
    entries: tuple[IndexedVariable, ...]
    total_bytes: int
    format: str

    def __len__(self) -> int:
        return len(self.entries)
