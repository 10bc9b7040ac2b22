"""A C-order reshape of any tensor source, read block by block.

`transforms.reshape` turns a reshape into a free view of a stored tensor, or
pushes it under a transpose where the merged dimensions stay adjacent; where
neither works (an `EinsumDense` kernel `(heads, hidden, head_dim)` that int4
quantization flattens to `(hidden, heads * head_dim)`, read from a
transposed Hugging Face tensor) it falls back to reading the whole input per
block. `FlatReshape` instead maps a block of the result to the contiguous
runs of the input's C order it covers, each run to at most `2 * rank` boxes
of the input, and reads only those boxes: no more bytes than the block.

Example:

```python
source = blockwise_reshape(transposed_kernel, (hidden, heads * head_dim))
source.read(((0, 8), (0, heads * head_dim)))  # 8 rows: a few input boxes
```
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from keras_hub_dist.formats import transforms
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import Index, TensorSource

__all__ = ["FlatReshape", "blockwise_reshape", "flat_boxes"]


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Index]:
    """Boxes of a C-order array of `shape` that cover its flat elements
    `[start, stop)`, in order (at most `2 * len(shape) - 1` of them)."""
    shape = tuple(int(d) for d in shape)
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    first, lo = divmod(start, inner)
    last, hi = divmod(stop, inner)
    if first == last:
        return [((first, first + 1),) + box for box in flat_boxes(shape[1:], lo, hi)]
    boxes: list[Index] = []
    if lo:
        boxes += [((first, first + 1),) + box for box in flat_boxes(shape[1:], lo, inner)]
        first += 1
    if last > first:
        boxes.append(((first, last),) + tuple((0, d) for d in shape[1:]))
    if hi:
        boxes += [((last, last + 1),) + box for box in flat_boxes(shape[1:], 0, hi)]
    return boxes


def _runs(shape: Sequence[int], index: Index) -> Iterator[tuple[int, int]]:
    """Flat `[start, stop)` runs of block `index` of a C-order array, in order."""
    shape = tuple(int(d) for d in shape)
    partial = [i for i, (a, b) in enumerate(index) if (a, b) != (0, shape[i])]
    last = partial[-1] if partial else -1
    if last < 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[last + 1 :])
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    outer = [range(a, b) for a, b in index[:last]]
    for k in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        base = sum((outer[i][j]) * strides[i] for i, j in enumerate(k))
        a, b = index[last]
        yield base + a * inner, base + b * inner


class FlatReshape(TensorSource):
    """`np.reshape(child, shape)` (C order), reading only a block's runs."""

    def __init__(self, child: TensorSource, shape: Sequence[int]) -> None:
        self.child, self.shape = child, tuple(int(d) for d in shape)
        self.dtype, self.description = child.dtype, child.description

    def _boxes(self, index: Index) -> list[Index]:
        merged: list[list[int]] = []
        for start, stop in _runs(self.shape, index):
            if merged and merged[-1][1] == start:
                merged[-1][1] = stop
            else:
                merged.append([start, stop])
        return [box for start, stop in merged for box in flat_boxes(self.child.shape, start, stop)]

    def read(self, index: Index) -> np.ndarray:
        out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        flat = out.reshape(-1)
        position = 0
        for box in self._boxes(index):
            part = self.child.read(box).reshape(-1)
            flat[position : position + part.size] = part
            position += part.size
        return out

    def read_nbytes(self, index: Index) -> int:
        return sum(self.child.read_nbytes(box) for box in self._boxes(index))


def blockwise_reshape(source: TensorSource, shape: Sequence[int]) -> TensorSource:
    """`transforms.reshape` where it is block-wise, else a `FlatReshape`
    (under a cast, which `transforms.reshape` would push the whole-tensor
    fallback under)."""
    if isinstance(source, transforms.Cast):
        return transforms.Cast(blockwise_reshape(source.child, shape), source.dtype)
    reshaped = transforms.reshape(source, shape)
    if isinstance(reshaped, transforms.FullTensorFallback):
        return FlatReshape(source, shape)
    return reshaped
