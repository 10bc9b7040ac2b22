"""Tensor sources that transform stored tensors, one block at a time.

A Hugging Face converter turns file tensors into a variable's value with a
handful of NumPy operations: reshape into heads, transpose, stack experts,
concatenate gate and up projections, cast. Each has a block-wise inverse:
block `index` of the result needs a known block of each input. These sources
compose those inverses, so a device's block is computed from exactly the
bytes it needs:

- `view(stored, shape)`: any reshape of a stored tensor is free, since the
  file is C-ordered: the result is a `StoredTensorSource` with the new shape,
  read as strided byte runs;
- `Transpose`, `Stack`, `Concat`, `Slice`, `Cast`, `Elementwise`: map the
  block to their inputs' blocks and apply the operation to those only;
- `reshape(source, shape)` pushes a reshape down to the stored tensor where
  it commutes with the operations above (a transpose of a split or merged
  dimension, a cast); where it cannot, `FullTensorFallback` reads the whole
  input on the host, once per block read, and says so (`fallback`).

Every `read` returns fresh, C-contiguous memory, and computes exactly what
the same NumPy operation on the whole tensor gives for that block (casts and
element-wise operations act per element; the others only move elements).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import (
    Index,
    StoredTensor,
    StoredTensorSource,
    TensorSource,
)

__all__ = [
    "Cast",
    "Concat",
    "Constant",
    "Elementwise",
    "FullTensorFallback",
    "Reshape",
    "Slice",
    "Stack",
    "Transpose",
    "fallbacks",
    "join",
    "reshape",
    "view",
]


def _full(shape: Sequence[int]) -> Index:
    return tuple((0, int(d)) for d in shape)


def _fresh(array: np.ndarray, dtype: Any = None) -> np.ndarray:
    out = host_io.aligned_empty(array.shape, np.dtype(dtype or array.dtype))
    out[...] = array
    return out


def view(stored: StoredTensor, shape: Sequence[int], description: str) -> StoredTensorSource:
    """The stored tensor seen with another shape of the same size."""
    shape = tuple(int(d) for d in shape)
    return StoredTensorSource(
        dataclasses.replace(stored, shape=shape), description
    )


class Constant(TensorSource):
    """A value the converter computed without reading the checkpoint."""

    def __init__(self, value: np.ndarray, description: str = "a constant") -> None:
        self.value = np.array(value)
        self.shape = tuple(self.value.shape)
        self.dtype = self.value.dtype
        self.description = description

    def read(self, index: Index) -> np.ndarray:
        return _fresh(self.value[tuple(slice(a, b) for a, b in index)])

    def read_nbytes(self, index: Index) -> int:
        return 0


class Transpose(TensorSource):
    """`np.transpose(child, perm)`."""

    def __init__(self, child: TensorSource, perm: Sequence[int]) -> None:
        self.child, self.perm = child, tuple(int(p) for p in perm)
        self.shape = tuple(child.shape[p] for p in self.perm)
        self.dtype = child.dtype
        self.description = child.description

    def child_index(self, index: Index) -> Index:
        """The block of the input that block `index` of the result is."""
        child_index = [None] * len(self.perm)
        for i, p in enumerate(self.perm):
            child_index[p] = index[i]
        return tuple(child_index)

    def read(self, index: Index) -> np.ndarray:
        # Large blocks are transposed on their devices instead
        # (`load.block_plan`, `device_perm`); these are small.
        return _fresh(self.child.read(self.child_index(index)).transpose(self.perm))

    def read_nbytes(self, index: Index) -> int:
        return self.child.read_nbytes(self.child_index(index))


class Slice(TensorSource):
    """`child[starts[0]:stops[0], ...]`, with the dimensions in `drop` (an
    integer index) removed."""

    def __init__(self, child: TensorSource, ranges: Index, drop: Sequence[int] = ()) -> None:
        self.child, self.ranges, self.drop = child, tuple(ranges), frozenset(drop)
        self.shape = tuple(b - a for i, (a, b) in enumerate(self.ranges) if i not in self.drop)
        self.dtype = child.dtype
        self.description = child.description

    def _child_index(self, index: Index) -> Index:
        kept = iter(index)
        out = []
        for i, (a, b) in enumerate(self.ranges):
            if i in self.drop:
                out.append((a, b))
            else:
                start, stop = next(kept)
                out.append((a + start, a + stop))
        return tuple(out)

    def read(self, index: Index) -> np.ndarray:
        block = self.child.read(self._child_index(index))
        return block.reshape(tuple(b - a for a, b in index))

    def read_nbytes(self, index: Index) -> int:
        return self.child.read_nbytes(self._child_index(index))


class _Joined(TensorSource):
    """Children joined along `axis` (a new one for stack, an existing one for
    concatenate); `spans[k]` is child k's range on that axis."""

    new_axis: bool

    def __init__(self, children: Sequence[TensorSource], axis: int, dtype: Any) -> None:
        self.children, self.axis = tuple(children), axis
        self.dtype = np.dtype(dtype)
        self.description = ", ".join(dict.fromkeys(c.description for c in children))
        sizes = [1 if self.new_axis else c.shape[axis] for c in children]
        starts = np.cumsum([0] + sizes)
        self.spans = tuple((int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))
        base = list(children[0].shape)
        if self.new_axis:
            base.insert(axis, len(children))
        else:
            base[axis] = int(starts[-1])
        self.shape = tuple(base)

    def _parts(self, index: Index):
        start, stop = index[self.axis]
        for child, (a, b) in zip(self.children, self.spans):
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                continue
            child_index = list(index)
            if self.new_axis:
                del child_index[self.axis]
            else:
                child_index[self.axis] = (lo - a, hi - a)
            yield child, tuple(child_index), (lo - start, hi - start)

    def read(self, index: Index) -> np.ndarray:
        out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        for child, child_index, (lo, hi) in self._parts(index):
            block = child.read(child_index)
            target = [slice(None)] * len(index)
            target[self.axis] = slice(lo, hi)
            out[tuple(target)] = block[(slice(None),) * self.axis + (None,)] if self.new_axis else block
        return out

    def read_nbytes(self, index: Index) -> int:
        return sum(c.read_nbytes(i) for c, i, _ in self._parts(index))


class Stack(_Joined):
    """`np.stack(children, axis)`."""

    new_axis = True


class Concat(_Joined):
    """`np.concatenate(children, axis)`."""

    new_axis = False


def join(kind: type, children: Sequence[TensorSource], axis: int, dtype: Any) -> TensorSource:
    """`Stack` or `Concat` of `children`, with a transpose they all share
    moved outside: `stack([x.T, y.T])` is `stack([x, y]).T` up to the axis
    order. Expert banks are built that way, and a transpose at the root can
    run on the devices (`load.block_plan`)."""
    perms = {c.perm for c in children if isinstance(c, Transpose)}
    if len(perms) != 1 or not all(isinstance(c, Transpose) for c in children):
        return kind(children, axis, dtype)
    (perm,) = perms
    inner = [c.child for c in children]
    if kind is Concat:
        return Transpose(Concat(inner, perm[axis], dtype), perm)
    outer = [1 + p for p in perm[:axis]] + [0] + [1 + p for p in perm[axis:]]
    return Transpose(Stack(inner, 0, dtype), outer)


class Cast(TensorSource):
    """`child.astype(dtype)`."""

    def __init__(self, child: TensorSource, dtype: Any) -> None:
        self.child, self.dtype = child, np.dtype(dtype)
        self.shape = child.shape
        self.description = child.description

    def read(self, index: Index) -> np.ndarray:
        return _fresh(self.child.read(index), self.dtype)

    def read_nbytes(self, index: Index) -> int:
        return self.child.read_nbytes(index)


class Elementwise(TensorSource):
    """A NumPy ufunc applied to sources of one shape and scalars."""

    def __init__(self, ufunc: np.ufunc, operands: Sequence[Any], kwargs: dict, dtype: Any) -> None:
        self.ufunc, self.operands, self.kwargs = ufunc, tuple(operands), dict(kwargs)
        sources = [o for o in operands if isinstance(o, TensorSource)]
        self.shape = sources[0].shape
        self.dtype = np.dtype(dtype)
        self.description = ", ".join(dict.fromkeys(s.description for s in sources))

    def read(self, index: Index) -> np.ndarray:
        args = [o.read(index) if isinstance(o, TensorSource) else o for o in self.operands]
        return _fresh(np.asarray(self.ufunc(*args, **self.kwargs)), self.dtype)

    def read_nbytes(self, index: Index) -> int:
        return sum(o.read_nbytes(index) for o in self.operands if isinstance(o, TensorSource))


class FullTensorFallback(TensorSource):
    """A transform with no block-wise form: reads its whole input on the
    host for each block (one tensor at a time, never on a device).

    Attributes:
        fallback: Why, for `LoadReport` and messages.
    """

    def __init__(
        self,
        inputs: Sequence[TensorSource],
        compute: Callable[..., np.ndarray],
        shape: Sequence[int],
        dtype: Any,
        reason: str,
    ) -> None:
        self.inputs, self.compute = tuple(inputs), compute
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.description = ", ".join(dict.fromkeys(s.description for s in inputs))
        self.fallback = reason

    def read(self, index: Index) -> np.ndarray:
        whole = np.asarray(self.compute(*(s.read(_full(s.shape)) for s in self.inputs)))
        return _fresh(whole[tuple(slice(a, b) for a, b in index)], self.dtype)

    def read_nbytes(self, index: Index) -> int:
        return sum(s.read_nbytes(_full(s.shape)) for s in self.inputs)


class Reshape(FullTensorFallback):
    """`np.reshape(child, shape)` after an operation it does not commute
    with: loaded as a `FullTensorFallback` (the whole input on the host);
    `child` is kept for readers that need no values (`formats.pieces`: a
    reshape moves no element in C order)."""

    def __init__(self, child: TensorSource, shape: Sequence[int]) -> None:
        shape = tuple(int(d) for d in shape)
        super().__init__(
            [child],
            lambda whole: whole.reshape(shape),
            shape,
            child.dtype,
            f"reshape of {child.description} from {tuple(child.shape)} to {shape} "
            "after an operation it does not commute with",
        )
        self.child = child


def fallbacks(source: TensorSource) -> list[str]:
    """The reasons of every full-tensor fallback inside `source`."""
    found = [source.fallback] if isinstance(source, FullTensorFallback) else []
    for attr in ("child", "children", "operands"):
        value = getattr(source, attr, None)
        for child in value if isinstance(value, tuple) else [value]:
            if isinstance(child, TensorSource):
                found += fallbacks(child)
    return found


def _dimension_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs of runs of dimensions of `a` and `b` with equal products (a
    reshape from `a` to `b` splits or merges within each pair)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        ga, gb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ga, gb))
    return groups


def _reshape_under_transpose(node: Transpose, shape: tuple[int, ...]) -> TensorSource | None:
    """`reshape(transpose(child, perm), shape)` as `transpose(reshape(child,
    shape'), perm')`, when every merged group is adjacent and in order in
    the child; `None` otherwise."""
    groups = _dimension_groups(node.shape, shape)
    group_of = {}
    for g, (ga, gb) in enumerate(groups):
        if len(ga) > 1 and len(gb) > 1:
            return None
        if len(ga) > 1 and [node.perm[p] for p in ga] != list(
            range(node.perm[ga[0]], node.perm[ga[0]] + len(ga))
        ):
            return None
        for p in ga:
            group_of[p] = g
    inverse = {c: p for p, c in enumerate(node.perm)}
    child_shape: list[int] = []
    labels: list[int] = []
    for c in range(len(node.perm)):
        ga, gb = groups[group_of[inverse[c]]]
        if not gb:
            continue  # a size-1 dimension that the reshape drops
        if len(ga) == 1:
            child_shape += [shape[d] for d in gb]
            labels += gb
        elif inverse[c] == ga[0]:
            child_shape.append(shape[gb[0]])
            labels.append(gb[0])
    for ga, gb in groups:
        if not ga:
            child_shape.append(1)
            labels += gb
    perm = [labels.index(d) for d in range(len(shape))]
    return Transpose(reshape(node.child, child_shape), perm)


def reshape(source: TensorSource, shape: Sequence[int]) -> TensorSource:
    """`np.reshape(source, shape)` (C order), block-wise where possible.

    Raises:
        ValueError: The sizes differ (as NumPy would).
    """
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(math.prod(source.shape) // max(known, 1) if d == -1 else d for d in shape)
    if math.prod(shape) != math.prod(source.shape):
        raise ValueError(
            f"cannot reshape array of size {math.prod(source.shape)} "
            f"(shape {source.shape}) into shape {shape}"
        )
    if shape == tuple(source.shape):
        return source
    reshaped = getattr(source, "reshaped", None)  # a source that reshapes itself
    if reshaped is not None and (own := reshaped(shape)) is not None:
        return own
    if source.stored is not None and tuple(source.stored.shape) == tuple(source.shape):  # its bytes exactly
        return view(source.stored, shape, source.description)
    if isinstance(source, Cast):
        return Cast(reshape(source.child, shape), source.dtype)
    if isinstance(source, Elementwise):
        return Elementwise(
            source.ufunc,
            [reshape(o, shape) if isinstance(o, TensorSource) else o for o in source.operands],
            source.kwargs,
            source.dtype,
        )
    if isinstance(source, Transpose):
        pushed = _reshape_under_transpose(source, shape)
        if pushed is not None:
            return pushed
    return Reshape(source, shape)
