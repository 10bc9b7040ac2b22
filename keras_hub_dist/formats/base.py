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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import keras
import ml_dtypes
import numpy as np

from keras_hub_dist.storage import host_io

# Where a block's bytes lie in a file is host_io's (it reads and writes them);
# re-exported here, where the reader protocol uses them.
from keras_hub_dist.storage.host_io import ByteRuns, Index, byte_runs

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
    "full_index",
    "index_slices",
    "is_float",
    "listing",
    "numpy_dtype",
]

# At most this many problems are spelled out in one error message.
_MAX_LISTED = 12


def listing(items: Sequence[str]) -> str:
    """Items of an error message, one per indented line, the first 12 only."""
    shown = list(items[:_MAX_LISTED])
    more = len(items) - len(shown)
    return "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")


def full_index(shape: Sequence[int]) -> Index:
    """The block of a whole array of `shape`."""
    return tuple((0, int(d)) for d in shape)


def index_slices(index: Index, origin: Index) -> tuple[slice, ...]:
    """Slices of block `index` inside an array that holds block `origin`."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(index, origin))


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
class StoredTensor:
    """A tensor stored uncompressed and C-contiguous at a byte offset of a file.

    Attributes:
        file: Path of the file.
        offset: Byte offset of element 0.
        shape: Shape of the stored tensor.
        dtype: Its dtype.
        opened: The file, opened by the format that indexed it (a remote
            object); `None` for a local path, opened when read.
    """

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    opened: Any = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def block_runs(self, index: Index) -> ByteRuns:
        """The file byte runs of block `index`, in the block's C order."""
        return byte_runs(self.shape, self.dtype.itemsize, index, self.offset)

    def read(self, index: Index, out: np.ndarray | None = None) -> np.ndarray:
        """Block `index` in fresh, aligned memory (one read per run), or in
        `out` (C-contiguous, the block's shape and dtype)."""
        if out is None:
            out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        file = self.opened if self.opened is not None else host_io.LocalFile(self.file)
        try:
            file.read_stretches(host_io.run_stretches(self.block_runs(index), out))
        finally:
            if self.opened is None:
                file.close()
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
        read_group: Sources with the same (non-`None`) group are computed
            from one shared reading (a quantized tensor's values, scale and
            zero): the loader reads adjacent ones one after another on one
            thread, so the later ones find what the first one kept.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    stored: StoredTensor | None = None
    description: str = ""
    read_group: Any = None

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

    def union_read_helps(self, indices: Sequence[Index]) -> bool:
        """Whether one read of the box these blocks tile, cut into them,
        beats a read per block (the loader's `"read_union"`): yes for a
        transform that reads strided runs per block; a source that computes
        every block from its own bytes alone says no (the cuts are a copy
        of every byte, on one thread)."""
        return True


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
        opened: The same files, opened (`host_io.LocalFile`, remote
            `RemoteFile`), where the format opened them.
    """

    files: tuple[str, ...]
    entries: tuple[IndexedVariable, ...]
    total_bytes: int
    format: str
    opened: tuple[Any, ...] = ()

    def __len__(self) -> int:
        return len(self.entries)
